"""The API process's side of the scheduler: tokenisation, request state, ZMQ.

One user request becomes a `RequestGroup` of sub-requests (n samples times
the prompts of a batch), each sent as its own `GenerateReq`. Outputs of all
sub-requests arrive on one asyncio queue per group, so streaming and
non-streaming responses read them the same way. Leaving a group's iterator
early (client hang-up, cancellation) aborts its unfinished sub-requests in
the scheduler at once, which frees their KV pages.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from servelm.config import ServerArgs
from servelm.managers.dp_dispatch import DataParallelDispatcher
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
from servelm.metrics import ServerMetrics
from servelm.sampling_params import SamplingParams

logger = logging.getLogger("servelm.tokenizer_manager")


class QueueFullError(Exception):
    """More requests are in flight than the server admits (answered with 429)."""


class DuplicateRequestIdError(ValueError):
    """A request id that is already in flight (answered with 400)."""


class CapacityError(ValueError):
    """A request that could never be admitted, however long it waited (answered with 400, not 429)."""


class SchedulerUnavailableError(Exception):
    """The scheduler did not answer (it is gone, or the server is stopping)."""


def resolve_tokenizer_path(server_args: ServerArgs) -> str:
    """The tokenizer source: --tokenizer-path, else the model path, else the default model."""
    if server_args.tokenizer_path:
        return server_args.tokenizer_path
    from servelm.model_loader.default_model import model_path_or_default

    return model_path_or_default(server_args.model_path)


def load_server_tokenizer(server_args: ServerArgs) -> Any:
    """Load the tokenizer the API process uses (with the --chat-template override)."""
    from servelm.model_loader.tokenizer import load_tokenizer

    return load_tokenizer(resolve_tokenizer_path(server_args), chat_template=server_args.chat_template)


@dataclass
class _SubRequest:
    rid: str  # internal id, the scheduler's: a fresh uuid, never derived from client text
    public_id: str  # what the client sees and may abort: the request's rid, or `rid-index` under n/batches
    index: int
    group: RequestGroup
    created: float
    dp_rank: int = 0  # the replica running it (--dp-size)
    prompt: list[int] | None = None  # its prompt, kept under --dp-size for the dispatcher's bookkeeping
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished: bool = False


@dataclass
class RequestGroup:
    """The sub-requests of one API request; iterate `outputs()` for `(index, TokenOut)` pairs."""

    rid: str
    manager: TokenizerManager
    subs: list[_SubRequest] = field(default_factory=list)
    n: int = 1  # choices per prompt: sub-request p * n + i is prompt p's choice i
    max_tokens: int | None = None  # the request's max_new_tokens (metrics)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    async def outputs(self) -> AsyncIterator[tuple[int, TokenOut]]:
        """Yield outputs as they arrive until every sub-request finished; abort the rest on early exit."""
        remaining = len(self.subs)
        try:
            while remaining:
                index, out = await self.queue.get()
                if out.finish_reason is not None:
                    remaining -= 1
                yield index, out
        finally:
            self.manager.abort_group(self)


class TokenizerManager:
    """Tokenizer, per-request state and the ZMQ link to the scheduler process.

    `to_scheduler_addr` is bound here as PUSH and `from_scheduler_addr` as
    PULL; the scheduler process connects to both. Under --dp-size there is one
    `to_scheduler_addr` a replica (a list), and every replica pushes to the one
    `from_scheduler_addr`; `DataParallelDispatcher` picks each prompt's replica.
    """

    def __init__(self, server_args: ServerArgs, to_scheduler_addr: str | list[str], from_scheduler_addr: str,
                 metrics: ServerMetrics) -> None:
        self.server_args = server_args
        self.metrics = metrics
        self.tokenizer: Any = None
        self.model_info: dict[str, Any] = {}
        self._max_in_flight = server_args.max_running_requests + server_args.max_queued_requests
        self.num_in_flight = 0
        self._subs: dict[str, _SubRequest] = {}  # by internal id
        # Every id a client can name (group rids and the public ids of their sub-requests), so that
        # an abort matches exactly one thing and a new request can never take over a running one.
        self._public: dict[str, RequestGroup | _SubRequest] = {}
        addrs = [to_scheduler_addr] if isinstance(to_scheduler_addr, str) else list(to_scheduler_addr)
        self.dp_size = len(addrs)
        self.dispatcher = (DataParallelDispatcher(self.dp_size, server_args.load_balance_method)
                           if self.dp_size > 1 else None)
        # Answers to control calls, in request order, one deque per replica.
        self._flush_waiters: list[collections.deque[asyncio.Future]] = [collections.deque() for _ in addrs]
        self._info_waiters: list[collections.deque[asyncio.Future]] = [collections.deque() for _ in addrs]
        self._token_text_cache: dict[int, str] = {}
        self._to_addr = to_scheduler_addr
        self._from_addr = from_scheduler_addr
        # Plain sockets for sending: sends must also work from `finally` blocks of
        # cancelled tasks (a hang-up), where awaiting is no longer possible.
        self._ctx = zmq.Context()
        self._sends = []
        for addr in addrs:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            if len(addrs) > 1:
                # A replica's sends never block (NOBLOCK): no limit on what waits for a busy replica (one request
                # may carry thousands of inputs), so that only a replica that is gone refuses a message.
                sock.setsockopt(zmq.SNDHWM, 0)
            sock.bind(addr)
            self._sends.append(sock)
        self._send = self._sends[0]
        self._actx = zmq.asyncio.Context()
        self._recv = self._actx.socket(zmq.PULL)
        self._recv.setsockopt(zmq.LINGER, 0)
        self._recv.bind(from_scheduler_addr)
        self._recv_task: asyncio.Task | None = None
        self._closed = False

    # ----------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start reading the scheduler's messages (call from the running event loop)."""
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())

    def close(self) -> None:
        """Fail what is in flight and close the sockets (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._recv_task is not None:
            self._recv_task.cancel()
        self.fail_all("server is shutting down")
        self._recv.close(0)
        for sock in self._sends:
            sock.close(0)
        self._actx.term()
        self._ctx.term()

    # ---------------------------------------------------------- tokenizer
    @property
    def max_in_flight(self) -> int:
        """Sequences in flight at most. An embedding server's are single inputs (one forward each, no KV
        held), so it holds 32 times as many: a request of OpenAI's 2048 inputs fits."""
        return self._max_in_flight * (32 if self.model_info.get("task") == "embed" else 1)

    def set_tokenizer(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        size = self.model_info.get("vocab_size")
        return int(size) if size else len(self.tokenizer)

    @property
    def context_length(self) -> int:
        return int(self.model_info.get("max_context_length") or 0)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def chat_prompt_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                        continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
                        template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Render the chat template (with the request's tools, for templates that show them, and its extra
        template variables, e.g. Qwen3's enable_thinking) and tokenize it (the template already holds any BOS)."""
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, **(template_kwargs or {}))
        return self.encode(text, add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """The text of one token, as logprobs show it (cached: logprobs ask for the same ids often)."""
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self._token_text_cache) < 200_000:
                self._token_text_cache[token_id] = text
        return text

    # ----------------------------------------------------------- requests
    def submit(self, prompts: list[list[int]], params: SamplingParams, rid: str, stream: bool,
               label_token_ids: list[int] | None = None,
               token_type_ids: list[list[int]] | None = None) -> RequestGroup:
        """Send `len(prompts) * params.n` GenerateReqs; sub-request `p * n + i` samples prompt p with index i.
        With `label_token_ids`, each final output also has their logprobs after its prompt (scoring).

        Raises QueueFullError (nothing is sent) when the server is full, CapacityError when the group
        could never fit, DuplicateRequestIdError when `rid` or one of its sub-request ids (`rid-i`)
        names a request in flight already.
        """
        n = params.n
        total = len(prompts) * n
        public_ids = [rid] if total == 1 else [f"{rid}-{index}" for index in range(total)]
        taken = next((x for x in (rid, *public_ids) if x in self._public), None)
        if taken is not None:
            raise DuplicateRequestIdError(f"request id {taken!r} is already in use by a running request")
        if total > self.max_in_flight:
            raise CapacityError(f"the request needs {total} sequences ({len(prompts)} prompt(s) x n={n}) but the "
                                f"server runs at most {self.max_in_flight} at once; send fewer")
        if self.num_in_flight + total > self.max_in_flight:
            self.metrics.observe_rejected()
            raise QueueFullError(
                f"server is at capacity ({self.num_in_flight} requests in flight, at most "
                f"{self.max_in_flight}); retry later")
        dispatcher = self.dispatcher
        if dispatcher is not None and not dispatcher.live():
            raise SchedulerUnavailableError("no data-parallel replica is up (they are restarting or have died); "
                                            "retry later")
        group = RequestGroup(rid=rid, manager=self, n=n, max_tokens=params.max_new_tokens)
        sampling = params.to_dict()
        now = time.monotonic()
        for p, ids in enumerate(prompts):
            # A prompt's n samples share its prefix: one replica for all of them.
            rank = dispatcher.choose(ids) if dispatcher is not None else 0
            for i in range(n):
                index = p * n + i
                sub = _SubRequest(rid=uuid.uuid4().hex, public_id=public_ids[index], index=index, group=group,
                                  created=now, dp_rank=rank)
                group.subs.append(sub)
                self._subs[sub.rid] = sub
                self._public[sub.public_id] = sub
                self.num_in_flight += 1
                msg = encode(GenerateReq(rid=sub.rid, input_ids=list(ids), sampling_params=sampling, stream=stream,
                                         sample_index=i, label_token_ids=label_token_ids,
                                         token_type_ids=token_type_ids[p] if token_type_ids else None))
                if dispatcher is None:
                    self._send.send(msg)
                    continue
                sub.prompt = list(ids)
                dispatcher.on_dispatch(rank, sub.prompt)
                try:  # never block the event loop on a replica that died a moment ago
                    self._sends[rank].send(msg, zmq.NOBLOCK)
                except zmq.Again:
                    self._on_output(sub, _failed_out(sub, f"data-parallel replica {rank} is not reachable"))
        self._public[rid] = group
        if self.server_args.log_requests:
            logger.info("request %s: %d prompt(s) x n=%d, prompt tokens %s, params %s", rid, len(prompts), n,
                        [len(ids) for ids in prompts], sampling)
        return group

    def abort_group(self, group: RequestGroup) -> None:
        """Abort the group's unfinished sub-requests now and forget them (late outputs are dropped)."""
        if self._public.get(group.rid) is group:
            del self._public[group.rid]
        for sub in group.subs:
            if sub.finished:
                continue
            sub.finished = True
            self._forget(sub)
            self.metrics.observe_aborted(sub.dp_rank)
            self._send_to(sub.dp_rank, AbortReq(sub.rid))
            if self.server_args.log_requests:
                logger.info("request %s aborted by the client", sub.public_id)

    def abort_request(self, rid: str) -> bool:
        """Ask the scheduler to abort the request whose id is exactly `rid` (a whole group, or one
        sub-request by its `rid-i` id); its client then receives a final output with finish reason
        `abort`. Returns whether such a request was running."""
        target = self._public.get(rid)
        if isinstance(target, RequestGroup):
            subs = [s for s in target.subs if not s.finished]
        else:
            subs = [target] if target is not None and not target.finished else []
        for sub in subs:
            self._send_to(sub.dp_rank, AbortReq(sub.rid))
        return bool(subs)

    def _send_to(self, rank: int, msg: Any) -> None:
        """A message for one replica that may be lost if the replica is gone (aborts: its requests then are
        too). A lone scheduler's socket blocks as before; a replica's never blocks."""
        with contextlib.suppress(zmq.ZMQError):
            if self.dispatcher is None:
                self._send.send(encode(msg))
            elif self.dispatcher.alive[rank]:
                self._sends[rank].send(encode(msg), zmq.NOBLOCK)

    def fail_all(self, message: str) -> None:
        """Finish every request in flight with an abort (the scheduler is gone)."""
        for sub in list(self._subs.values()):
            self._on_output(sub, _failed_out(sub, message))
        for rank in range(self.dp_size):
            self._fail_waiters(rank, message)

    def _fail_waiters(self, rank: int, message: str) -> None:
        for waiters in (self._flush_waiters[rank], self._info_waiters[rank]):
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_exception(SchedulerUnavailableError(message))

    def replica_down(self, rank: int, message: str) -> int:
        """Data-parallel replica `rank` died: end its requests with `message`, send it nothing more. Returns
        how many requests it ended."""
        assert self.dispatcher is not None
        self.dispatcher.set_alive(rank, False)
        subs = [sub for sub in self._subs.values() if sub.dp_rank == rank]
        for sub in subs:
            self._on_output(sub, _failed_out(sub, message))
        self._fail_waiters(rank, message)
        return len(subs)

    def replica_up(self, rank: int) -> None:
        """Replica `rank` (re)started and is ready: dispatch to it again (its cache starts empty)."""
        assert self.dispatcher is not None
        self.dispatcher.set_alive(rank, True)
        self.metrics.forget_replica(rank)

    def _forget(self, sub: _SubRequest) -> None:
        if self._subs.pop(sub.rid, None) is not None:
            self.num_in_flight -= 1
            if self.dispatcher is not None and sub.prompt is not None:
                self.dispatcher.on_finish(sub.dp_rank, sub.prompt)
        if self._public.get(sub.public_id) is sub:
            del self._public[sub.public_id]
        group = sub.group
        if all(s.finished for s in group.subs) and self._public.get(group.rid) is group:
            del self._public[group.rid]

    def _on_output(self, sub: _SubRequest, out: TokenOut) -> None:
        now = time.monotonic()
        if out.token_ids:
            if sub.first_token_time is None:
                sub.first_token_time = now
                self.metrics.observe_first_token(now - sub.created, sub.dp_rank)
            else:
                self.metrics.observe_inter_token(now - (sub.last_token_time or now), len(out.token_ids), sub.dp_rank)
            sub.last_token_time = now
            self.metrics.observe_generated(len(out.token_ids), sub.dp_rank)
        if out.finish_reason is not None:
            sub.finished = True
            self._forget(sub)
            self.metrics.observe_finished(out.finish_reason.type, now - sub.created, out.prompt_tokens,
                                          out.cached_tokens, out.completion_tokens, sub.group.max_tokens, sub.dp_rank)
            if sub.index % sub.group.n == 0:  # once per prompt, as vLLM counts a request's n
                self.metrics.observe_request_n(sub.group.n, sub.dp_rank)
            self.metrics.observe_request_times(out.timings, out.completion_tokens, sub.dp_rank)
            if self.server_args.log_requests:
                logger.info("request %s finished: %s, %d prompt + %d completion tokens (%d cached), %.3fs",
                            sub.public_id, out.finish_reason.to_dict(), out.prompt_tokens, out.completion_tokens,
                            out.cached_tokens, now - sub.created)
        sub.group.queue.put_nowait((sub.index, out))

    # ------------------------------------------------------ control calls
    async def _call(self, msg: Any, waiters: list[collections.deque], timeout: float, rank: int = 0) -> Any:
        fut = asyncio.get_running_loop().create_future()
        waiters[rank].append(fut)
        if self.dispatcher is None:
            self._send.send(encode(msg))
        else:
            try:
                self._sends[rank].send(encode(msg), zmq.NOBLOCK)
            except zmq.Again:
                waiters[rank].remove(fut)
                raise SchedulerUnavailableError(f"data-parallel replica {rank} is not reachable") from None
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            who = "the scheduler" if self.dispatcher is None else f"data-parallel replica {rank}"
            raise SchedulerUnavailableError(f"{who} did not answer within {timeout:.0f}s") from None

    async def _call_live(self, make: Any, waiters: list[collections.deque], timeout: float) -> dict[int, Any]:
        """The answer of every live replica (a failed or timed-out one's SchedulerUnavailableError instead)."""
        assert self.dispatcher is not None
        ranks = self.dispatcher.live()
        if not ranks:
            raise SchedulerUnavailableError("no data-parallel replica is up (they are restarting or have died)")
        answers = await asyncio.gather(*(self._call(make(), waiters, timeout, r) for r in ranks),
                                       return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException) and not isinstance(answer, SchedulerUnavailableError):
                raise answer
        return dict(zip(ranks, answers, strict=True))

    async def flush_cache(self, timeout: float = 30.0) -> FlushCacheOut:
        if self.dispatcher is None:
            return await self._call(FlushCacheReq(), self._flush_waiters, timeout)
        answers = await self._call_live(FlushCacheReq, self._flush_waiters, timeout)
        failed = {r: (a.message if isinstance(a, FlushCacheOut) else str(a)) for r, a in answers.items()
                  if not (isinstance(a, FlushCacheOut) and a.success)}
        return FlushCacheOut(not failed, "; ".join(f"replica {r}: {m}" for r, m in sorted(failed.items())))

    async def server_info(self, timeout: float = 30.0) -> dict[str, Any]:
        """The scheduler's state; under --dp-size the replicas' totals, and each one's own under `replicas`."""
        if self.dispatcher is None:
            out: ServerInfoOut = await self._call(ServerInfoReq(), self._info_waiters, timeout)
            return out.info
        answers = await self._call_live(ServerInfoReq, self._info_waiters, timeout)
        return merge_replica_info(self.dispatcher, {r: (a.info if isinstance(a, ServerInfoOut) else {"error": str(a)})
                                                    for r, a in answers.items()})

    async def _recv_loop(self) -> None:
        while True:
            raw = await self._recv.recv()
            try:
                msg = decode(raw)
            except Exception:
                logger.exception("dropping undecodable message from the scheduler")
                continue
            if isinstance(msg, BatchTokenOut):
                if self.dispatcher is not None:
                    if not self.dispatcher.alive[msg.dp_rank]:
                        continue  # the last words of a replica declared dead
                    if msg.cache_events:
                        self.dispatcher.on_events(msg.dp_rank, msg.cache_events)
                self.metrics.observe_steps(msg.iteration_tokens, msg.num_preemptions, msg.dp_rank)
                for out in msg.outputs:
                    sub = self._subs.get(out.rid)
                    if sub is not None:  # else: aborted by its client already
                        self._on_output(sub, out)
            elif isinstance(msg, (FlushCacheOut, ServerInfoOut)):
                waiters = (self._flush_waiters if isinstance(msg, FlushCacheOut) else self._info_waiters)[msg.dp_rank]
                # Answers come back in request order, one per request, even for a waiter that
                # timed out in the meantime (its answer is then dropped).
                if waiters:
                    fut = waiters.popleft()
                    if not fut.done():
                        fut.set_result(msg)
            else:
                logger.warning("ignoring unexpected message %s from the scheduler", type(msg).__name__)


def _failed_out(sub: _SubRequest, message: str) -> TokenOut:
    """A sub-request's final output when it failed outside its scheduler (ours to blame: a 503)."""
    return TokenOut(rid=sub.rid, token_ids=[], text="", prompt_tokens=0, completion_tokens=0, cached_tokens=0,
                    finish_reason=FinishReason.abort(message, internal=True))


# Keys of a replica's server_info that add up over the replicas.
_SUMMED = ("kv_total_tokens", "kv_free_tokens", "kv_cached_tokens", "kv_in_use_tokens", "num_running", "num_waiting",
           "cache_hit_tokens", "cache_query_tokens")


def merge_replica_info(dispatcher: DataParallelDispatcher, infos: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """/server_info under --dp-size: the replicas' totals at the top (so a reader of one server's fields reads the
    whole), and each replica's own state, load and dispatch count under `replicas`."""
    ok = [info for info in infos.values() if "error" not in info]
    merged: dict[str, Any] = dict(ok[0]) if ok else {}
    merged.pop("pid", None)  # a replica's own
    for key in merged:
        if (key in _SUMMED or key.endswith("_total") or key.startswith("spec_decode_num_")) and all(
                isinstance(i.get(key), int) for i in ok):
            merged[key] = sum(i[key] for i in ok)
    if ok:
        merged["kv_integrity_ok"] = all(i.get("kv_integrity_ok", True) for i in ok)
        hits, queries = merged.get("cache_hit_tokens"), merged.get("cache_query_tokens")
        if isinstance(hits, int) and isinstance(queries, int):
            merged["cache_hit_rate"] = hits / queries if queries else 0.0
    merged["dp_size"] = dispatcher.dp_size
    merged.update(dispatcher.info())
    merged["replicas"] = [
        {"dp_rank": r, "alive": dispatcher.alive[r] and "error" not in infos.get(r, {"error": "down"}),
         "load": dispatcher.load[r], "dispatched": dispatcher.dispatched[r],
         "mirror_cached_tokens": dispatcher.cached[r].tokens, **infos.get(r, {})}
        for r in range(dispatcher.dp_size)]
    return merged


def tokenizer_display_path(server_args: ServerArgs) -> str:
    """The tokenizer path for /model_info (never raises)."""
    try:
        return os.fspath(resolve_tokenizer_path(server_args))
    except Exception:
        return ""
