"""Rank 0 -> other TP ranks: the channel that carries each step, kept alive while idle.

The followers wait for the next step in a broadcast on the CPU group, and
every gloo collective has the process group's deadline (`--dist-timeout`):
that deadline is what lets a rank notice a dead peer instead of hanging, but
it would also kill an idle server. So rank 0 sends a keep-alive (a no-op
step that followers skip) whenever no step went out for a quarter of the
timeout. Followers still notice within the timeout when rank 0 dies or hangs,
and an idle server stays up forever.

Rank 0 holds `StepSender.lock` across each whole step, its broadcast and every
collective of its forward, so a keep-alive (sent from a thread) never lands
between a step's collectives: a follower would take it for one of them. Per
step that is one uncontended lock and one clock read.
"""

from __future__ import annotations

import multiprocessing.util
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from servelm.distributed.parallel_state import broadcast_object, payload_bytes_sent
from servelm.distributed.step_codec import StepDecoder, StepEncoder

# What a keep-alive broadcasts. A str, so it never collides with a StepInput or with None (stop).
KEEP_ALIVE = "servelm:tp-keep-alive"

# Keep-alives go out after this fraction of the timeout without a step: the margin covers a
# keep-alive delayed by a busy machine (the thread must get the GIL and the lock in time).
KEEP_ALIVE_FRACTION = 0.25

# multiprocessing.util.Finalize priority of `StepSender.stop`: any priority >= 0 runs before
# multiprocessing terminates a process's daemonic children at exit (the TP followers).
EXIT_PRIORITY = 10


class StepSender:
    """Rank 0's end: `send` broadcasts a step (call it with `lock` held, and keep holding it
    until the step's forward is done); a thread sends keep-alives while no step goes out.

    `on_failure(exc)` runs in the keep-alive thread when a keep-alive broadcast fails (a peer
    died); the thread then ends.
    """

    def __init__(self, timeout_s: float, on_failure: Callable[[BaseException], None],
                 rows_needed: bool = False) -> None:
        self.lock = threading.Lock()
        # Only what changed since the last step goes out (servelm.distributed.step_codec); the followers'
        # sampling rows only when they sample (`rows_needed`: the LM-head all-to-all).
        self._encoder = StepEncoder(rows_needed)
        self.steps_sent = 0
        self.step_bytes_sent = 0
        self.interval_s = timeout_s * KEEP_ALIVE_FRACTION
        self._on_failure = on_failure
        self._last_sent = time.monotonic()
        self.keep_alives_sent = 0
        self._stopped = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._keep_alive, name="tp-keep-alive", daemon=True)
        self._thread.start()
        # At interpreter exit (or at the end of a multiprocessing child, such as the server's
        # scheduler process) the daemonic followers are terminated without a close(): stop the
        # keep-alives first, so one sent into a terminated follower is not taken for a lost rank.
        self._at_exit = multiprocessing.util.Finalize(self, self.stop, exitpriority=EXIT_PRIORITY)

    def send(self, step: Any) -> None:
        """Broadcast `step` to the followers (the caller holds `lock`)."""
        if isinstance(step, str):  # a keep-alive
            broadcast_object(step)
        else:
            before = payload_bytes_sent()
            broadcast_object(self._encoder.encode(step))
            self.steps_sent += 1
            self.step_bytes_sent += payload_bytes_sent() - before
        self._last_sent = time.monotonic()

    def _keep_alive(self) -> None:
        failure = self._send_keep_alives()
        # A failure after stop() is the process tearing down its ranks, not news.
        if failure is not None and not self._stopped.is_set():
            self._on_failure(failure)

    def _send_keep_alives(self) -> BaseException | None:
        """Until stopped, a keep-alive whenever no step went out for `interval_s`; returns the
        broadcast failure that ended it, if one did."""
        wait_s = self.interval_s
        while not self._stopped.wait(wait_s):
            with self.lock:
                if self._stopped.is_set():
                    return None
                idle_s = time.monotonic() - self._last_sent
                if idle_s >= self.interval_s:
                    try:
                        self.send(KEEP_ALIVE)
                    except Exception as exc:
                        return exc
                    self.keep_alives_sent += 1
                    idle_s = 0.0
            # Next check when the last step (or keep-alive) is one interval old.
            wait_s = self.interval_s - idle_s
        return None

    def stop(self) -> None:
        """Stop sending keep-alives (the process is exiting; the followers are being stopped)."""
        self._stopped.set()

    def close(self) -> None:
        """Stop the keep-alives and release the followers from `receive_steps` (broadcast None)."""
        self._stopped.set()
        self._at_exit.cancel()
        with self.lock:
            if not self._closed:
                self._closed = True
                broadcast_object(None)
        if self._thread is not threading.current_thread():
            self._thread.join()


def receive_steps() -> Iterator[Any]:
    """A follower's end: every step rank 0 sends (rebuilt from what changed), keep-alives skipped, until rank 0
    closes."""
    decoder = StepDecoder()
    while (step := broadcast_object(None)) is not None:
        if not (isinstance(step, str) and step == KEEP_ALIVE):
            yield decoder.decode(step)
