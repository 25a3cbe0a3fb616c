"""Tools that some tests need and servelm does not depend on (the ecosystem's routers), each installed once, pinned,
into a virtual environment of its own under .venv/tools/ (so its dependencies never touch servelm's). A test
that cannot install one skips with one line saying why; CI has PyPI, so it never should."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

TOOLS_DIR = Path(__file__).resolve().parent.parent / ".venv" / "tools"

# name -> (the packages, pinned; the executable run from the tool's bin/). sgl-router's console scripts include
# `smg`, so each router gets its own environment.
ROUTERS: dict[str, tuple[list[str], str]] = {
    "smg": (["smg==1.13.0", "setproctitle==1.3.8"], "smg"),
    "sglang-router": (["sglang-router==0.3.2", "setproctitle==1.3.8", "aiohttp==3.14.5", "orjson==3.13.0",
                       "uvicorn==0.55.0", "fastapi==0.165.0"], "python"),
    "vllm-router": (["vllm-router==0.1.17", "setproctitle==1.3.8", "aiohttp==3.14.5", "orjson==3.13.0",
                     "uvicorn==0.55.0", "fastapi==0.165.0", "requests==2.34.2"], "vllm-router"),
}


def install(name: str) -> Path:
    """The tool's bin/ folder, installed on first use (the routers' wheels carry their Rust binaries: their own
    dependencies are only the Python launchers', so they are installed without resolving anything else)."""
    packages, _ = ROUTERS[name]
    env = TOOLS_DIR / name
    stamp = env / ".installed"
    if stamp.exists() and stamp.read_text() == " ".join(packages):
        return env / "bin"
    try:
        venv.EnvBuilder(with_pip=True, clear=True).create(env)
        pip = [str(env / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, "--no-deps", packages[0]], check=True, capture_output=True, text=True, timeout=600)
        subprocess.run([*pip, *packages[1:]], check=True, capture_output=True, text=True, timeout=600)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        pytest.skip(f"cannot install {name} ({' '.join(packages)}): {detail.strip().splitlines()[-1:]}")
    stamp.write_text(" ".join(packages))
    return env / "bin"


if __name__ == "__main__":  # python -m tests.tools: install them all now (e.g. before an offline run)
    for tool in sys.argv[1:] or list(ROUTERS):
        print(tool, install(tool))
