"""The image request queue and its batching loop (on the server's event loop).

Requests wait in FIFO order in a bounded queue (`QueueFull` beyond it: a 429). When the pipeline is free,
the oldest request and every later one with the same batch key (size, steps, guidance, ...) run as one
pipeline call, up to `max_batch_size` images; a request is never split. The call runs in one worker thread;
a request whose client hung up leaves the queue at once, or, running, stops the call before its next step
when no other request of the batch still wants its images.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Protocol

from servelm.diffusion.metrics import DiffusionMetrics
from servelm.diffusion.runtime import BatchCancelled, ImageJob

logger = logging.getLogger("servelm.diffusion")


class QueueFull(Exception):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__("The image queue is full")
        self.retry_after_s = retry_after_s


class RequestFailed(Exception):
    """A request ended without images: cancelled, the server stopping, or a pipeline failure."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


class Runner(Protocol):
    def run(self, jobs: list[ImageJob], on_step: object = None) -> list[list[bytes]]: ...


@dataclass
class Pending:
    job: ImageJob
    future: asyncio.Future[list[bytes]]
    arrived: float = field(default_factory=time.monotonic)


class ImageScheduler:
    def __init__(self, runner: Runner, metrics: DiffusionMetrics, max_batch_size: int, max_queued: int,
                 batch_wait_s: float) -> None:
        self.runner = runner
        self.metrics = metrics
        self.max_batch_size = max_batch_size
        self.max_queued = max_queued
        self.batch_wait_s = batch_wait_s
        self.waiting: list[Pending] = []
        self.running: list[Pending] = []
        self._wakeup = asyncio.Event()
        self._batch_seconds = 0.0  # the last pipeline call's wall time: the Retry-After estimate
        # One thread runs every pipeline call: torch's CPU thread settings are per calling thread.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="servelm-diffusion")

    @property
    def num_in_flight(self) -> int:
        return len(self.waiting) + len(self.running)

    def submit(self, job: ImageJob) -> Pending:
        """Queue `job`; QueueFull when `max_queued` requests already wait."""
        if len(self.waiting) >= self.max_queued:
            self.metrics.rejected.inc()
            raise QueueFull(max(1, math.ceil(self._batch_seconds)))
        pending = Pending(job, asyncio.get_running_loop().create_future())
        self.waiting.append(pending)
        self.metrics.waiting.set(len(self.waiting))
        self._wakeup.set()
        return pending

    def cancel(self, pending: Pending) -> None:
        """The client hung up: drop it from the queue, or mark it so the running call can stop."""
        pending.job.cancelled = True
        if pending in self.waiting:
            self.waiting.remove(pending)
            self.metrics.waiting.set(len(self.waiting))
        self._finish(pending, RequestFailed("cancelled", 499), "aborted")

    def fail_all(self, message: str) -> None:
        """End every request with a 503 (the server is stopping); a running call stops before its next step."""
        for pending in [*self.waiting, *self.running]:
            pending.job.cancelled = True
            self._finish(pending, RequestFailed(message, 503), "aborted")
        self.waiting.clear()
        self.metrics.waiting.set(0)

    async def run_forever(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self.waiting:
                if self.batch_wait_s and sum(p.job.n for p in self.waiting) < self.max_batch_size:
                    await asyncio.sleep(self.batch_wait_s)  # let requests sent together join one batch
                batch = self._take_batch()
                if batch:
                    await self._run(batch)

    def _take_batch(self) -> list[Pending]:
        if not self.waiting:
            return []
        key, images, batch = self.waiting[0].job.batch_key(), 0, []
        for pending in list(self.waiting):
            if pending.job.batch_key() != key:
                continue
            if batch and images + pending.job.n > self.max_batch_size:
                break
            batch.append(pending)
            images += pending.job.n
            self.waiting.remove(pending)
        self.metrics.waiting.set(len(self.waiting))
        return batch

    async def _run(self, batch: list[Pending]) -> None:
        self.running = batch
        self.metrics.running.set(len(batch))
        images = sum(p.job.n for p in batch)
        self.metrics.batch.observe(images)
        logger.info("Denoising a batch of %d image(s) from %d request(s)", images, len(batch))
        started = time.monotonic()
        try:
            results = await asyncio.get_running_loop().run_in_executor(
                self._executor, self.runner.run, [p.job for p in batch], self.metrics.step.observe)
        except BatchCancelled as exc:
            logger.info("Stopped a batch of %d request(s) after %d of %d denoising step(s): every client left",
                        len(batch), exc.steps_done, batch[0].job.steps)
        except Exception as exc:
            logger.exception("The pipeline failed on a batch of %d request(s)", len(batch))
            for pending in batch:
                self._finish(pending, RequestFailed(f"The pipeline failed: {type(exc).__name__}: {exc}"), "error")
        else:
            for pending, pngs in zip(batch, results):
                self._finish(pending, pngs, "ok")
        finally:
            self._batch_seconds = time.monotonic() - started
            for pending in batch:  # cancelled while running: ended by cancel()/fail_all already
                self._finish(pending, RequestFailed("cancelled", 499), "aborted")
            self.running = []
            self.metrics.running.set(0)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _finish(self, pending: Pending, result: list[bytes] | RequestFailed, outcome: str) -> None:
        if pending.future.done():
            return
        if isinstance(result, RequestFailed):
            pending.future.set_exception(result)
            pending.future.exception()  # marked as seen: a hung-up client awaits nothing
        else:
            pending.future.set_result(result)
        self.metrics.finished(outcome, time.monotonic() - pending.arrived, len(result) if outcome == "ok" else 0)


async def stop_task(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
