"""servelm.cpu_memory: glibc keeps freed activation memory in the model's processes."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from servelm import cpu_memory


def _recorder(result: int = 1):
    calls: list[tuple[int, int]] = []

    def mallopt(param: int, value: int) -> int:
        calls.append((param, value))
        return result

    return calls, mallopt


def test_sets_the_mmap_and_trim_thresholds():
    calls, mallopt = _recorder()
    assert cpu_memory.configure_malloc({}, mallopt) is True
    assert calls == [(cpu_memory.M_MMAP_THRESHOLD, 32 << 20), (cpu_memory.M_TRIM_THRESHOLD, 512 << 20)]


@pytest.mark.parametrize("name", cpu_memory.USER_VARS)
def test_the_users_malloc_variables_win(name):
    calls, mallopt = _recorder()
    assert cpu_memory.configure_malloc({name: "1"}, mallopt) is False
    assert calls == []


def test_a_refused_setting_is_reported():
    calls, mallopt = _recorder(result=0)
    assert cpu_memory.configure_malloc({}, mallopt) is False


_PROBE = """
import ctypes, sys
sys.path.insert(0, {root!r})
from servelm import cpu_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
if {configure}:
    assert cpu_memory.configure_malloc({{}})
p = libc.malloc(20 << 20)  # about a 512-token chunk's activation of a 1B model
mapped = libc.mallinfo2().hblkhd
libc.free(p)
print(mapped >= 20 << 20)
"""


def _glibc_version() -> tuple[int, ...]:
    lib, version = platform.libc_ver()
    return tuple(int(p) for p in version.split(".")) if lib == "glibc" and version else ()


@pytest.mark.skipif(not sys.platform.startswith("linux") or _glibc_version() < (2, 33),
                    reason="glibc's allocator, mallinfo2 (glibc 2.33+)")
def test_glibc_serves_a_20_mb_block_from_the_heap_once_configured():
    import pathlib

    root = str(pathlib.Path(__file__).resolve().parents[1])
    env = {"PATH": "/usr/bin:/bin"}  # no MALLOC_* of the caller's

    def mapped(configure: bool) -> str:
        code = _PROBE.format(root=root, configure=configure)
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              check=True, timeout=120).stdout.strip()

    assert mapped(False) == "True"  # glibc's default: a fresh process mmaps it
    assert mapped(True) == "False"  # configured: from the heap, so its pages stay for the next step
