"""JIT build of the C++ kernels in `csrc/`: compiled once per (sources, flags, torch, Python, machine, compiler
version) into a per-user cache dir, loaded as torch ops (`torch.ops.servelm_quant`, and `torch.ops.servelm_fused`:
the fused layer ops of `fused_ops.cpp`, servelm.layers.fused).

Processes that build at the same time (TP ranks) serialise on an flock in the cache dir (released by the
kernel if a builder dies, unlike torch's own `lock` file, which is cleared when found stale under the flock).
No compiler or a failed build: `load_quant_ops()` returns False after one warning line, and callers use torch.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("quant_ops.cpp", "quant_scalar.cpp", "quant_avx2.cpp", "quant_avx512.cpp", "quant_avx512_vnni.cpp",
           "tiles_scalar.cpp", "tiles_avx2.cpp", "tiles_avx512.cpp", "panels_avx512_vnni.cpp", "panels_avx2.cpp",
           "rows16_avx512_vnni.cpp", "rows16_avx2.cpp", "rows16_amx.cpp", "fused_ops.cpp")
CFLAGS = ["-O3", "-ffp-contract=off", "-std=c++17", "-fopenmp"]  # no fp contraction: dequantised values stay
# exactly gguf's; OpenMP: at::parallel_for is inline, so without it the kernel runs on one thread
LDFLAGS = ["-fopenmp"]
CACHE_ENV = "SERVELM_KERNEL_CACHE"


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "servelm" / "kernels"


def _compiler_version() -> str:
    """First line of `$CXX --version` (a compiler upgrade rebuilds); empty when it cannot run."""
    try:
        out = subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def build_key() -> str:
    """Hash of everything the built library depends on."""
    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(repr((CFLAGS, LDFLAGS, torch.__version__, sys.version_info[:2], platform.machine(),
                   _compiler_version())).encode())
    return h.hexdigest()[:16]


def _missing_tools() -> str | None:
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the kernels target x86-64, this machine is {platform.machine()}"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH"
    from torch.utils.cpp_extension import is_ninja_available

    _put_pip_ninja_on_path()
    if not is_ninja_available():
        return "ninja is not installed"
    return None


def _put_pip_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the `ninja` dependency installs it beside this Python, which is not on
    PATH when servelm runs as `.venv/bin/servelm` without an activated venv."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + (os.pathsep + path if path else "")


def _build_and_load(name: str, build_dir: Path) -> None:
    from torch.utils.cpp_extension import load

    lib = build_dir / f"{name}.so"
    with open(build_dir / "servelm.flock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists() and (build_dir / "complete").exists():
            torch.ops.load_library(str(lib))
            return
        (build_dir / "lock").unlink(missing_ok=True)  # torch's baton, stale if a builder died
        logger.info("Building servelm's quantised-weight kernels (once per machine, ~1 min) in %s", build_dir)
        t0 = time.monotonic()
        # copies: torch appends its own -L/-l flags to the list it is given, which changed build_key() after a build
        load(name=name, sources=[str(CSRC / s) for s in SOURCES], extra_cflags=list(CFLAGS),
             extra_ldflags=list(LDFLAGS),
             build_directory=str(build_dir),
             is_python_module=False, verbose=False)
        (build_dir / "complete").touch()
        logger.info("Built servelm's quantised-weight kernels in %.1f s", time.monotonic() - t0)


@cache
def load_quant_ops() -> bool:
    """Build (first time) and load the kernels; False, after one warning line, when that is not possible."""
    problem = _missing_tools()
    if problem is None:
        try:
            key = build_key()
            build_dir = cache_root() / key
            build_dir.mkdir(parents=True, exist_ok=True)
            _build_and_load(f"servelm_quant_{key}", build_dir)
            return True
        except Exception as e:  # a broken toolchain must not stop serving: the torch path still works
            problem = f"the build failed ({type(e).__name__}: {str(e).strip().splitlines()[-1][:300]})"
    logger.warning("servelm quantised-weight kernels unavailable, using the slower torch path: %s", problem)
    return False


if __name__ == "__main__":  # `python -m servelm.kernels.build`: build now (make setup), not on first use
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load_quant_ops()
