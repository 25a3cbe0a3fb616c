"""A pool of real rank processes over gloo for the distributed tests.

`World(ws)` spawns `ws` processes that join one TP group with
`init_distributed` (tcp://127.0.0.1:<free port>) and then run whatever
module-level function `World.run(fn, *args)` sends them, on every rank at
once, returning each rank's result in rank order. One spawn serves many
tests (importing torch in 4-6 processes on 2 cores is the slow part).
Results travel as `torch.save` bytes, so tensors of any dtype come back
without shared-memory handles. A failing or hung rank breaks the world: it
is torn down and `run` raises with every rank's traceback; the next `run`
starts a fresh one.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _worker(rank: int, ws: int, addr: str, tasks: Any, results: Any) -> None:
    torch.set_num_threads(1)  # ws processes share 2 cores
    from servelm.distributed.parallel_state import destroy_distributed, init_distributed

    try:
        init_distributed(ws, rank, addr, timeout_s=60)
    except BaseException:
        results.put((rank, "err", traceback.format_exc()))
        return
    results.put((rank, "ready", b""))
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args = item
        try:
            results.put((rank, "ok", _dumps(fn(*args))))
        except BaseException:
            results.put((rank, "err", traceback.format_exc()))
    destroy_distributed()
    # Every result has been received by now; skip the interpreter's slow teardown of torch.
    os._exit(0)


class World:
    """`ws` rank processes in one TP group; `run(fn, *args)` -> [result of rank 0, rank 1, ...]."""

    def __init__(self, world_size: int, start_timeout_s: float = 60) -> None:
        self.world_size = world_size
        self.start_timeout_s = start_timeout_s
        self.procs: list[Any] = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        addr = f"127.0.0.1:{free_port()}"
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.world_size)]
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.procs = [ctx.Process(target=_worker, args=(r, self.world_size, addr, self.tasks[r], self.results),
                                  daemon=True) for r in range(self.world_size)]
        for p in self.procs:
            p.start()
        self._collect("ready", self.start_timeout_s)

    def _collect(self, expect: str, timeout_s: float) -> list[Any]:
        got: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) + len(errors) < self.world_size and time.monotonic() < deadline:
            try:
                rank, status, payload = self.results.get(timeout=0.5)
            except queue.Empty:
                for r, p in enumerate(self.procs):
                    if not p.is_alive() and r not in got and r not in errors:
                        errors[r] = f"rank {r} died (exit code {p.exitcode})"
                        deadline = min(deadline, time.monotonic() + 3.0)
                continue
            if status == "err":
                # The other ranks may now sit in a collective forever: give them a moment only.
                deadline = min(deadline, time.monotonic() + 3.0)
                errors[rank] = payload
            else:
                got[rank] = payload
        if errors or len(got) < self.world_size:
            self.close()
            missing = [r for r in range(self.world_size) if r not in got and r not in errors]
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"world of {self.world_size} failed ({expect}); no answer from ranks "
                                 f"{missing}\n{detail}")
        if expect == "ready":
            return []
        return [torch.load(io.BytesIO(got[r]), weights_only=False) for r in range(self.world_size)]

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 30) -> list[Any]:
        """Run module-level `fn(*args)` on every rank; returns the results in rank order."""
        if not self.procs:
            self._start()
        for q in self.tasks:
            q.put((fn, args))
        return self._collect(fn.__name__, timeout_s)

    def close(self) -> None:
        """Stop the rank processes (politely, then by force)."""
        for q, p in zip(getattr(self, "tasks", []), self.procs):
            if p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.procs = []

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
