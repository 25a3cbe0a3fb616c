"""A child process that must not outlive its parent (the scheduler process, a TP rank's worker)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Make this process exit when `parent_pid` dies, however it dies (even SIGKILL).

    Linux's PR_SET_PDEATHSIG does it in the kernel; a thread polling the
    parent pid covers other systems and the window before prctl took effect.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
