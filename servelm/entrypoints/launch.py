"""Starting and stopping the LLM server: the port (bound before the model loads), the scheduler process
and its lifetime, uvicorn with a graceful SIGTERM drain, logging.

Process layout: this process runs the event loop, tokenisation and chat templates (`TokenizerManager`); the
model runs in one scheduler process (`run_scheduler_process`, multiprocessing "spawn") reached over ZMQ ipc
sockets in a private temp dir. The HTTP port opens at once: `/health` answers 503 until the scheduler has
loaded the model, then 200.

With `--dp-size N` there are N scheduler processes (replicas), each on its own CPUs with its own ipc socket; the
API process dispatches each prompt (`servelm.managers.dp_dispatch`). A replica that dies has its requests ended
with an error and is restarted once; the others keep serving.

Testing hook: `SERVELM_SCHEDULER_FACTORY=module:attr` in the environment runs `attr(server_args)` instead of
`engine_core.build_scheduler` in the scheduler process (see `servelm.managers.scheduler_process`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.resource_tracker
import os
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI

from servelm.config import ServerArgs
from servelm.entrypoints.http_common import GracefulServer, ServerError, configure_logging, listen_socket
from servelm.entrypoints.http_server import ServerState, build_app, served_model_name
from servelm.managers.scheduler_process import run_scheduler_process
from servelm.managers.tokenizer_manager import TokenizerManager, load_server_tokenizer
from servelm.metrics import ServerMetrics

logger = logging.getLogger("servelm.http_server")

SCHEDULER_STOP_TIMEOUT_S = 5.0


def scheduler_lifespan(state: ServerState) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """The app's lifespan: start the scheduler link and watch the start-up; on the way out stop both."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.manager.start()
        startup = asyncio.create_task(_startup(state))
        try:
            yield
        finally:
            state.shutting_down = True
            state.stop_event.set()
            startup.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await startup
            _stop_scheduler(*([r.proc for r in state.replicas] if state.replicas else [state.proc]))
            state.manager.close()

    return lifespan


def _wait_ready(state: ServerState, replica: Replica | None = None) -> dict[str, Any]:
    """Block until the scheduler (or one replica) reports on its pipe (or dies, or we stop)."""
    reader, proc = (state.ready_reader, state.proc) if replica is None else (replica.reader, replica.proc)
    assert reader is not None and proc is not None
    while not state.stop_event.is_set():
        if reader.poll(0.2):
            try:
                return reader.recv()
            except EOFError:
                break
        if not proc.is_alive():
            break
    code = proc.exitcode
    return {"status": "error", "message": f"the scheduler process exited (code {code}) before it was ready"}


def cache_config_labels(args: ServerArgs, info: dict[str, Any]) -> dict[str, Any]:
    """vLLM's cache_config_info labels (its CacheConfig field names) from the flags and the scheduler's model
    info: a page is vLLM's block, the pool's pages its num_gpu_blocks, wherever the pool lives."""
    page = args.page_size
    capacity = info.get("kv_capacity_tokens")
    return {"block_size": page, "cache_dtype": info.get("kv_cache_dtype", args.kv_cache_dtype),
            "enable_prefix_caching": not args.disable_radix_cache,
            "num_gpu_blocks": capacity // page if isinstance(capacity, int) else None,
            "num_cpu_blocks": None}


def _load_harmony_if_used(args: Any, tokenizer: Any) -> None:
    """With the harmony parsers (gpt-oss), load openai-harmony's encoding before serving, so that a missing
    package or vocabulary stops start-up with one line (servelm.entrypoints.harmony says what to do)."""
    from servelm.entrypoints import reasoning, tool_parsers

    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else None
    fmt = reasoning.resolve(args.reasoning_parser, template)
    if (fmt is not None and fmt.harmony) or tool_parsers.resolve(args.tool_call_parser, template) == "openai":
        from servelm.entrypoints import harmony

        harmony.encoding(tokenizer)


async def _startup(state: ServerState) -> None:
    """Load the tokenizer while the scheduler loads the model; then mark ready and watch the scheduler."""
    args = state.server_args
    manager = state.manager
    try:
        tokenizer_task = asyncio.ensure_future(asyncio.to_thread(load_server_tokenizer, args))
        # When the scheduler fails first, nobody awaits the tokenizer: mark its error as seen, or asyncio
        # prints it with a traceback ("exception was never retrieved") when the task is collected.
        tokenizer_task.add_done_callback(lambda t: t.cancelled() or t.exception())
        if state.replicas:
            msgs = await asyncio.gather(*(asyncio.to_thread(_wait_ready, state, r) for r in state.replicas))
            failed = next(((r, m) for r, m in zip(state.replicas, msgs, strict=True) if m.get("status") != "ready"),
                          None)
            msg = msgs[0] if failed is None else {"status": "error", "message": failed[1].get("message")}
        else:
            msg = await asyncio.to_thread(_wait_ready, state)
        if state.stop_event.is_set():
            return
        if msg.get("status") != "ready":
            state.fail(f"The scheduler failed to start: {msg.get('message')}")
            return
        try:
            tokenizer = await tokenizer_task
        except Exception as exc:
            state.fail(f"Could not load the tokenizer: {type(exc).__name__}: {exc}")
            return
        try:
            await asyncio.to_thread(_load_harmony_if_used, args, tokenizer)
        except RuntimeError as exc:  # HarmonyUnavailable: what to install or set
            state.fail(str(exc))
            return
        manager.set_tokenizer(tokenizer)
        manager.model_info = dict(msg.get("model_info") or {})
        info = manager.model_info
        dispatcher = manager.dispatcher
        if dispatcher is not None and dispatcher.method == "cache_aware" and (
                info.get("task") in ("embed", "score") or args.disable_radix_cache):
            # Nothing is cached to route to: each request goes where the fewest are in flight.
            dispatcher.method = "shortest_queue"
            logger.info("Data-parallel dispatch: shortest_queue (the replicas keep no prefix cache)")
        state.metrics.set_cache_config(cache_config_labels(args, info))
        state.ready = True
        if info.get("task") == "embed":
            logger.info("servelm ready in %.1f s: embedding model %s (%s), %s dimensions, %s pooling, at most %s "
                        "tokens an input, serving POST /v1/embeddings at http://%s:%d",
                        time.monotonic() - state.started_at, state.model_name, info.get("architecture", "?"),
                        info.get("embedding_dimensions", "?"), info.get("pooling", "?"),
                        info.get("max_context_length", "?"), args.host, args.port)
        else:
            logger.info("servelm ready in %.1f s: model %s (%s), dtype %s, KV capacity %s tokens, context %s, "
                        "serving at http://%s:%d", time.monotonic() - state.started_at, state.model_name,
                        info.get("architecture", "?"),
                        info.get("dtype", "?"), info.get("kv_capacity_tokens", "?"),
                        info.get("max_context_length", "?"), args.host, args.port)
        if state.replicas:
            logger.info("%d data-parallel replicas serve (%s dispatch): %s", len(state.replicas),
                        manager.dispatcher.method, "; ".join(f"replica {r.rank} on CPUs {r.cpu_text}"
                                                             for r in state.replicas))
            await _watch_replicas(state)
            return
        while True:
            await asyncio.sleep(0.5)
            proc = state.proc
            if proc is not None and not proc.is_alive() and not state.shutting_down:
                rank = " (TP rank 0)" if args.tp_size > 1 else ""
                state.fail(f"The scheduler process{rank} died unexpectedly (exit code {proc.exitcode}); stopping")
                return
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # never leave the server half-started
        logger.exception("startup failed")
        state.fail(f"Startup failed: {type(exc).__name__}: {exc}")


class Replica:
    """One data-parallel replica: its scheduler process, start-up pipe, CPUs and restarts."""

    def __init__(self, rank: int, addr: str, cpus: list[int]) -> None:
        from servelm.managers.dp_dispatch import format_cpu_list

        self.rank = rank
        self.addr = addr
        self.cpus = cpus
        self.cpu_text = format_cpu_list(cpus)
        self.proc: Any = None
        self.reader: Any = None
        self.restarts = 0

    def start(self, args: ServerArgs, from_scheduler: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        self.reader = reader
        self.proc = ctx.Process(target=run_scheduler_process, name=f"servelm-scheduler-dp{self.rank}", daemon=False,
                                args=(args, self.addr, from_scheduler, writer, os.getpid(), self.rank, self.cpus))
        self.proc.start()
        writer.close()


REPLICA_RESTARTS = 1  # a replica that died is restarted this many times, then left down


async def _watch_replicas(state: ServerState) -> None:
    """Watch the replicas: a dead one has its requests ended with an error and is restarted once (the others
    serve meanwhile); the server stops only when none is left."""
    manager = state.manager
    restarting: dict[int, asyncio.Task] = {}
    while True:
        await asyncio.sleep(0.5)
        if state.shutting_down:
            return
        for replica in state.replicas:
            if replica.rank in restarting or not manager.dispatcher.alive[replica.rank] or replica.proc.is_alive():
                continue
            code = replica.proc.exitcode
            lost = manager.replica_down(replica.rank, f"data-parallel replica {replica.rank} died (exit code {code}) "
                                                      "while running this request")
            if replica.restarts < REPLICA_RESTARTS:
                logger.error("Data-parallel replica %d died (exit code %s); %d request(s) on it ended with an error. "
                             "Restarting it; the other replicas keep serving", replica.rank, code, lost)
                replica.restarts += 1
                restarting[replica.rank] = asyncio.ensure_future(_restart(state, replica))
            else:
                logger.error("Data-parallel replica %d died again (exit code %s); %d request(s) on it ended with an "
                             "error. It is not restarted again; %d replica(s) keep serving", replica.rank, code, lost,
                             len(manager.dispatcher.live()))
        for rank, task in list(restarting.items()):
            if task.done():
                del restarting[rank]
        if not manager.dispatcher.live() and not restarting:
            state.fail("Every data-parallel replica has died; stopping")
            return


async def _restart(state: ServerState, replica: Replica) -> None:
    replica.reader.close()
    replica.start(state.server_args, state.from_scheduler)
    msg = await asyncio.to_thread(_wait_ready, state, replica)
    if state.stop_event.is_set():
        return
    if msg.get("status") != "ready":
        logger.error("Data-parallel replica %d did not restart: %s", replica.rank, msg.get("message"))
        return
    state.manager.replica_up(replica.rank)
    logger.info("Data-parallel replica %d restarted on CPUs %s and serves again", replica.rank, replica.cpu_text)


def _stop_scheduler(*procs: Any) -> None:
    """Stop the scheduler process (or every replica's, all at once), then the resource tracker."""
    alive = [p for p in procs if p is not None and p.is_alive()]
    if not alive:
        return
    names = "the scheduler process" if len(procs) == 1 else f"{len(alive)} data-parallel replica(s)"
    logger.info("Stopping %s", names)
    for proc in alive:
        proc.terminate()
    deadline = time.monotonic() + SCHEDULER_STOP_TIMEOUT_S
    for proc in alive:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            logger.warning("%s did not stop within %.0fs; killing it", proc.name, SCHEDULER_STOP_TIMEOUT_S)
            proc.kill()
            proc.join(SCHEDULER_STOP_TIMEOUT_S)
    logger.info("Stopped %s (exit code(s) %s)", names, ", ".join(str(p.exitcode) for p in alive))
    # NOTE: starting a 'spawn' process also started multiprocessing's resource tracker, a child
    # that ignores SIGTERM (so a process reaper would wait for it, then SIGKILL it). Stop it
    # now; it restarts by itself if anything needs it again. `_stop` is private, hence getattr.
    # It waits for every process that shares it to let go, hence after all of them.
    tracker = getattr(multiprocessing.resource_tracker, "_resource_tracker", None)
    with contextlib.suppress(Exception):
        getattr(tracker, "_stop", lambda: None)()


async def _drain(state: ServerState, stop_signal: int | None) -> None:
    """Stop gracefully: new requests already get 503 (`shutting_down`, while the port stays open); running
    ones get up to --shutdown-timeout seconds (none on Ctrl-C, which a person wants at once) to finish;
    then each still open is ended with a 503 error body, or an SSE error event and [DONE]."""
    manager = state.manager
    grace = 0.0 if stop_signal == signal.SIGINT else state.server_args.shutdown_timeout
    deadline = time.monotonic() + grace
    def alive() -> bool:
        if state.replicas:
            return any(r.proc is not None and r.proc.is_alive() for r in state.replicas)
        return state.proc is not None and state.proc.is_alive()

    while manager.num_in_flight and time.monotonic() < deadline and alive():
        await asyncio.sleep(0.05)
    if manager.num_in_flight:
        logger.warning("Shutting down: ending %d running request(s) with an error%s", manager.num_in_flight,
                       f" after the {grace:g}s grace period (--shutdown-timeout)" if grace else "")
        manager.fail_all("The server is shutting down")
    # uvicorn's shutdown then waits (timeout_graceful_shutdown) for the handlers to send those errors.


def launch_server(server_args: ServerArgs) -> None:
    """Start the scheduler process and serve HTTP until Ctrl-C/SIGTERM; blocks for the server's lifetime.

    Raises ServerError when the port cannot be had, or the scheduler fails to start or dies. The
    scheduler process is stopped on every way out.
    """
    configure_logging(server_args.log_level)
    if server_args.node_rank > 0:
        # Other nodes of a multi-node TP group only run their ranks; node 0 serves HTTP.
        from servelm.managers.tp_worker import run_node_workers

        code = run_node_workers(server_args)
        if code:
            from servelm.distributed.failures import PEER_LOST_EXIT_CODE

            if code == PEER_LOST_EXIT_CODE:
                raise ServerError(f"the TP ranks on node {server_args.node_rank} lost their peers (node 0, or a rank "
                                  "on another node, died or stopped answering)")
            raise ServerError(f"a TP rank on node {server_args.node_rank} exited with code {code}")
        return
    dp = server_args.dp_size
    cpu_sets: list[list[int]] = []
    if dp > 1:
        from servelm.managers.dp_dispatch import replica_cpu_sets

        try:
            cpu_sets = replica_cpu_sets(dp, server_args.dp_cpus, sorted(os.sched_getaffinity(0)))
        except ValueError as exc:
            raise ServerError(str(exc)) from None
    # The port first, before the model loads: a port in use is one line at once, not after the load.
    sock = listen_socket(server_args.host, server_args.port)
    tmpdir = tempfile.mkdtemp(prefix="servelm-")
    to_scheduler = [f"ipc://{os.path.join(tmpdir, f'to_scheduler{r}')}" for r in range(dp)]
    from_scheduler = f"ipc://{os.path.join(tmpdir, 'from_scheduler')}"
    model_name = served_model_name(server_args)
    metrics = ServerMetrics(model_name, dp_size=dp)
    manager = TokenizerManager(server_args, to_scheduler if dp > 1 else to_scheduler[0], from_scheduler, metrics)
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    replicas = [Replica(r, to_scheduler[r], cpu_sets[r]) for r in range(dp)] if dp > 1 else []
    # Not a daemon: under TP the scheduler process starts the other ranks. It still dies with
    # this process (die_with_parent) and is stopped on every way out below.
    proc = None if replicas else ctx.Process(target=run_scheduler_process, name="servelm-scheduler", daemon=False,
                                             args=(server_args, to_scheduler[0], from_scheduler, writer, os.getpid()))
    state = ServerState(server_args=server_args, model_name=model_name, manager=manager, metrics=metrics,
                        proc=proc, ready_reader=reader, replicas=replicas, from_scheduler=from_scheduler)
    try:
        if replicas:
            logger.info("Loading model %s in %d data-parallel replicas", server_args.model_path or "(default model)",
                        dp)
            for replica in replicas:
                replica.start(server_args, from_scheduler)
            state.proc = replicas[0].proc
        else:
            logger.info("Loading model %s in the scheduler process", server_args.model_path or "(default model)")
            proc.start()
        writer.close()
        app = build_app(state, lifespan=scheduler_lifespan(state))
        config = uvicorn.Config(app, host=server_args.host, port=server_args.port,
                                log_level=server_args.uvicorn_log_level or server_args.log_level,
                                access_log=not server_args.disable_uvicorn_access_log, timeout_graceful_shutdown=3,
                                timeout_keep_alive=5)
        server = GracefulServer(config, state, drain=lambda sig: _drain(state, sig))
        state.uvicorn_server = server
        # uvicorn logs no "Uvicorn running on ..." for a socket it is given: nothing may be sent yet, and
        # "servelm ready" is the line that says when.
        logger.info("HTTP port open at http://%s:%d; loading the model (requests get 503 until it is ready)",
                    server_args.host, server_args.port)
        server.run(sockets=[sock])
    finally:
        state.shutting_down = True
        state.stop_event.set()
        _stop_scheduler(*([r.proc for r in replicas] if replicas else [proc]))
        for replica in replicas:
            replica.reader.close()
        with contextlib.suppress(Exception):
            manager.close()
        reader.close()
        sock.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
    if state.fatal_error:
        raise ServerError(state.fatal_error)
