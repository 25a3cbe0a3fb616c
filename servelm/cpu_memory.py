"""The C library's allocator in the model's processes: freed activation memory is kept for the next step.

A prompt chunk's activations are tensors of several MB (the Llama-3.2-1B shape at 512 tokens: 4 MB per
hidden state, 16-32 MB for the MLP's). glibc serves such sizes with mmap, or from the heap and then trims
the heap's free top, so every forward faulted its activation pages in afresh and the kernel zeroed them:
`perf` of `servelm bench one-batch --input-len 512` on that model put 11% of the prompt's time in the
kernel (5.8% `clear_page_erms`). `configure_malloc` sets glibc's mmap threshold to its largest value (32 MB)
and keeps up to `TRIM_THRESHOLD` of freed heap memory, as the environment variables
MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=536870912 would. With those two set as variables the
kernel's share fell to 5% (what is left: first touches of the KV pool's pages, and tensors of 32 MB and more);
with this module, against the commit before, the 512-token prompt ran x1.05 faster (median of 7 interleaved
rounds' ratios, 2-core Zen 4; docs/measurements/quant-kernels.md, "Nineteenth session"), and the default
model's prompt, whose activations are smaller, did not move. The price is resident memory: up to
TRIM_THRESHOLD of freed memory stays with the process instead of going back to the system. A user's own
MALLOC_* variables win; other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
from collections.abc import Callable, Mapping

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 512 << 20
USER_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def _glibc_mallopt() -> Callable[[int, int], int] | None:
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        fn = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


def configure_malloc(env: Mapping[str, str] | None = None,
                     mallopt: Callable[[int, int], int] | None = None) -> bool:
    """Keep freed activation memory in this process (see the module's docstring); True when it was set.

    Nothing is changed where the user set one of glibc's MALLOC_* tuning variables, or off glibc."""
    env = os.environ if env is None else env
    if any(name in env for name in USER_VARS):
        return False
    mallopt = mallopt or _glibc_mallopt()
    if mallopt is None:
        return False
    # mallopt returns 1 on success; a value it refuses leaves that setting as it was
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not done:
        logger.debug("mallopt refused the allocator settings; glibc's defaults stay")
    return done
