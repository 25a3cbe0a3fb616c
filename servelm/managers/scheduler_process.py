"""The scheduler process: owns the model, talks to the API process over ZMQ.

The loop blocks on its socket while the scheduler is idle and only drains it
(without waiting) while there is work, so an idle server burns no CPU and a
busy one never waits for a message between steps. Every step's outputs go
back as one `BatchTokenOut`.

Bad input never ends the loop: `add_request` errors come back to the API as
a finished output with an abort `FinishReason` that says why.

`SERVELM_SCHEDULER_FACTORY=module:attr` (an environment variable, read in
this process) replaces `engine_core.build_scheduler` with `attr(server_args)`;
tests use it to run a stand-in scheduler without a model.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import zmq

from servelm.config import ServerArgs
from servelm.cpu_threads import ThreadGovernor
from servelm.managers.io_struct import (
    AbortReq,
    BatchTokenOut,
    FinishReason,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReq,
    ServerInfoOut,
    ServerInfoReq,
    TokenOut,
    decode,
    encode,
)
from servelm.managers.parent_watch import die_with_parent

logger = logging.getLogger("servelm.scheduler_process")

SCHEDULER_FACTORY_ENV = "SERVELM_SCHEDULER_FACTORY"
_IDLE_POLL_MS = 250
STATS_INTERVAL_S = 10.0  # how often a busy server logs its throughput line
# Step statistics ride on the next output message; without outputs (non-streamed decoding) they go on their
# own after this many steps or seconds, so /metrics lags a busy scheduler by at most that much.
STEP_STATS_MAX_STEPS = 256
STEP_STATS_MAX_AGE_S = 1.0


def _load_factory() -> Any:
    spec = os.environ.get(SCHEDULER_FACTORY_ENV)
    if not spec:
        from servelm.managers.engine_core import build_scheduler

        return build_scheduler
    module_name, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _abort_out(req: GenerateReq, message: str) -> TokenOut:
    return TokenOut(rid=req.rid, token_ids=[], text="", prompt_tokens=len(req.input_ids), completion_tokens=0,
                    cached_tokens=0, finish_reason=FinishReason.abort(message))


class SchedulerLoop:
    """Dispatches API messages to a scheduler and sends its outputs back."""

    def __init__(self, scheduler: Any, recv: zmq.Socket, send: zmq.Socket,
                 stats_interval_s: float = STATS_INTERVAL_S, governor: ThreadGovernor | None = None,
                 dp_rank: int | None = None) -> None:
        self.scheduler = scheduler
        # A data-parallel replica tags its answers and publishes its prefix cache's events (the API process
        # dispatches on a mirror of it); a lone scheduler does neither.
        self.dp_rank = dp_rank or 0
        self._replica = dp_rank is not None
        cache = getattr(scheduler, "cache", None)
        self._cache = cache if dp_rank is not None and hasattr(cache, "events") else None
        if self._cache is not None:
            self._cache.events = []
        self.governor = governor  # fewer model threads while other processes want the CPUs
        self.recv = recv
        self.send = send
        self.stop_requested = False
        self.stats_interval_s = stats_interval_s
        self._stats_at = time.monotonic()
        self._stats_totals: tuple[int, int] | None = None
        self._step_tokens: list[int] = []  # tokens of each step not yet reported
        self._preemptions_sent = 0
        self._steps_sent_at = time.monotonic()

    def log_stats(self, force: bool = False) -> None:
        """Every `stats_interval_s` while requests run, one line as vLLM logs it: prompt and generation
        throughput over the interval, running and waiting requests, KV usage and prefix-cache hits."""
        now = time.monotonic()
        stats = getattr(self.scheduler, "stats", None)
        if not isinstance(stats, dict) or (not force and now - self._stats_at < self.stats_interval_s):
            return
        totals = (int(stats.get("prompt_tokens", 0)), int(stats.get("generation_tokens", 0)))
        last, self._stats_totals = self._stats_totals or totals, totals
        elapsed, self._stats_at = max(now - self._stats_at, 1e-9), now
        if totals == last and not self.scheduler.has_work():
            return  # idle: nothing to say
        info = self.scheduler.server_info()
        used = info.get("kv_in_use_tokens", 0) + info.get("kv_cached_tokens", 0)
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%% (%.1f%% by running requests), "
                    "Prefix cache hit rate: %.1f%%", (totals[0] - last[0]) / elapsed, (totals[1] - last[1]) / elapsed,
                    info.get("num_running", 0), info.get("num_waiting", 0),
                    100.0 * used / max(info.get("kv_total_tokens", 1), 1),
                    100.0 * info.get("kv_in_use_tokens", 0) / max(info.get("kv_total_tokens", 1), 1),
                    100.0 * float(info.get("cache_hit_rate") or 0.0))

    def _handle(self, msg: Any) -> None:
        sched = self.scheduler
        if isinstance(msg, GenerateReq):
            try:
                sched.add_request(msg)
            except Exception as exc:  # the API validates first; this is the safety net
                logger.warning("request %s rejected by the scheduler: %s", msg.rid, exc)
                self.send.send(encode(BatchTokenOut([_abort_out(msg, str(exc))])))
        elif isinstance(msg, AbortReq):
            try:
                outs = sched.abort_request(msg.rid)
            except Exception:
                logger.exception("abort of %s failed", msg.rid)
                outs = None
            # The final outputs of aborted requests (finish reason "abort") may come back here
            # or from the next step, depending on the scheduler.
            if outs:
                self.send.send(encode(BatchTokenOut(list(outs))))
        elif isinstance(msg, FlushCacheReq):
            try:
                ok = bool(sched.flush_cache())
                out = FlushCacheOut(ok, "" if ok else "cannot flush the cache while requests are running",
                                    dp_rank=self.dp_rank)
            except Exception as exc:
                out = FlushCacheOut(False, str(exc), dp_rank=self.dp_rank)
            if self._cache is not None and self._cache.events:
                self._send_outputs([])  # the "emptied" event goes before the answer
            self.send.send(encode(out))
        elif isinstance(msg, ServerInfoReq):
            try:
                info = dict(sched.server_info())
            except Exception as exc:
                info = {"error": str(exc)}
            if self._replica:
                info["pid"] = os.getpid()  # a replica's process, for an operator (or a test) to find
            self.send.send(encode(ServerInfoOut(info, dp_rank=self.dp_rank)))
        else:
            logger.warning("ignoring unexpected message %s", type(msg).__name__)

    def _receive(self, block: bool) -> list[Any]:
        msgs: list[Any] = []
        if block and not self.recv.poll(_IDLE_POLL_MS):
            return msgs
        while True:
            try:
                raw = self.recv.recv(zmq.NOBLOCK)
            except zmq.Again:
                return msgs
            try:
                msgs.append(decode(raw))
            except Exception:
                logger.exception("dropping undecodable message")

    def run_once(self) -> None:
        """Receive what is there (waiting only while idle), dispatch it, then run one step."""
        for msg in self._receive(block=not self.scheduler.has_work()):
            self._handle(msg)
        working = self.scheduler.has_work()
        if working:
            outputs = self.scheduler.step()
            self._send_outputs(list(outputs or []))
        elif self._cache is not None and self._cache.events:  # e.g. an abort gave its pages to the tree
            self._send_outputs([])
        self.log_stats()
        if self.governor is not None and working:  # the model's threads compete only while it runs
            self.governor.tick()

    def _send_outputs(self, outputs: list[TokenOut]) -> None:
        """Send a step's outputs with the step statistics gathered so far (or those alone once they are due)."""
        tokens = getattr(self.scheduler, "last_step_tokens", 0)
        if tokens:
            self._step_tokens.append(int(tokens))
        stats = getattr(self.scheduler, "stats", None)
        preemptions = int(stats.get("retractions", 0)) - self._preemptions_sent if isinstance(stats, dict) else 0
        now = time.monotonic()
        due = len(self._step_tokens) >= STEP_STATS_MAX_STEPS or now - self._steps_sent_at >= STEP_STATS_MAX_AGE_S
        events = self._cache.events if self._cache is not None else None
        if not outputs and not events and not (due and (self._step_tokens or preemptions)):
            return
        if events:
            self._cache.events = []
        self.send.send(encode(BatchTokenOut(outputs, iteration_tokens=self._step_tokens, num_preemptions=preemptions,
                                            dp_rank=self.dp_rank, cache_events=events or [])))
        self._step_tokens, self._steps_sent_at = [], now
        self._preemptions_sent += preemptions

    def request_stop(self) -> None:
        """Stop after the current step (safe to call from a signal handler)."""
        self.stop_requested = True

    def run_forever(self) -> None:
        while not self.stop_requested:
            self.run_once()


def run_scheduler_process(server_args: ServerArgs, recv_addr: str, send_addr: str, ready_writer: Connection,
                          parent_pid: int | None = None, dp_rank: int | None = None,
                          cpus: list[int] | None = None) -> None:
    """Entry point of the scheduler process (a multiprocessing 'spawn' target).

    Loads the model, then sends `{"status": "ready", "model_info": {...}}` on
    `ready_writer` (or `{"status": "error", "message": ...}` and exits 1), then
    serves requests from `recv_addr` (PULL) and sends outputs to `send_addr`
    (PUSH) until it is terminated or its parent dies.

    A data-parallel replica (`dp_rank` given) runs on its own `cpus` (its TP ranks inherit them), with
    as many threads as they allow unless the user chose a count.
    """
    die_with_parent(parent_pid if parent_pid is not None else os.getppid())
    # Ctrl-C reaches the whole process group; the API process decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # While loading there is nothing to save; once serving, SIGTERM only asks the loop to stop
    # (raising from a signal handler could land in a destructor, where it would be swallowed).
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    tag = f"[DP{dp_rank}] " if dp_rank is not None else ""
    logging.basicConfig(level=server_args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s {tag}%(name)s: %(message)s")
    if cpus:
        from servelm.cpu_threads import configure_cpu_threads
        from servelm.managers.dp_dispatch import format_cpu_list

        os.sched_setaffinity(0, cpus)
        threads = configure_cpu_threads(server_args.num_threads, processes=server_args.tp_ranks_per_node)
        logger.info("Data-parallel replica %s on CPUs %s, %d thread(s) a TP rank", dp_rank, format_cpu_list(cpus),
                    threads.num_threads)
    try:
        scheduler = _load_factory()(server_args)
        model_info = dict(scheduler.model_info())
    except Exception as exc:
        # The API process reports the message (the CLI's one `Error:` line); the traceback is for debugging.
        if os.environ.get("SERVELM_DEBUG") == "1":
            logger.error("scheduler failed to start:\n%s", traceback.format_exc())
        with contextlib.suppress(Exception):
            ready_writer.send({"status": "error", "message": f"{type(exc).__name__}: {exc}"})
        sys.exit(1)

    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.connect(recv_addr)
    send = ctx.socket(zmq.PUSH)
    send.setsockopt(zmq.LINGER, 0)
    send.connect(send_addr)
    loop = SchedulerLoop(scheduler, recv, send, governor=ThreadGovernor.for_process(
        server_args.num_threads, processes=server_args.tp_ranks_per_node,
        deterministic=server_args.enable_deterministic_inference), dp_rank=dp_rank)
    signal.signal(signal.SIGTERM, lambda *_: loop.request_stop())
    ready_writer.send({"status": "ready", "model_info": model_info})
    ready_writer.close()
    try:
        loop.run_forever()
    except Exception as exc:
        from servelm.distributed.failures import TPFailure

        # A TPFailure is the consequence of a TP rank's death, and the one line naming that
        # rank is already logged: a traceback of the consequence would only point elsewhere.
        if not isinstance(exc, TPFailure):
            logger.critical("scheduler loop crashed:\n%s", traceback.format_exc())
        os._exit(1)
    # Release the TP workers (they leave their follow loop and exit on their own) instead of leaving
    # them to be terminated, which would leak their semaphores.
    shutdown = getattr(scheduler, "shutdown", None)
    if shutdown is not None:
        try:
            shutdown()
        except Exception as exc:  # stopping anyway: say what failed, once
            logger.warning("scheduler shutdown failed: %s: %s", type(exc).__name__, exc)
    recv.close(0)
    send.close(0)
    ctx.term()
