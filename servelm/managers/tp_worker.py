"""Processes of the TP ranks other than rank 0.

Rank 0 lives in the scheduler's process (the server's scheduler process, or
the caller's process for the offline Engine). It starts the other ranks of
its node here, before joining the rendezvous; on other nodes
`run_node_workers` starts that node's ranks. Each worker loads its shard and
runs `ModelRunner.follow()`. Workers die with their parent, and rank 0 dies
(with a clear log line) when a worker dies, so a lost rank never hangs the
server.

When a rank dies, the others' collectives fail too; those are consequences.
A worker whose collective failed exits with `PEER_LOST_EXIT_CODE` after one
short line, and rank 0 logs one line naming the rank that died
(`TPWorkers.report_death`), however the news reached it first: its watcher
thread, a failed step or a failed keep-alive.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import signal
import socket
import sys
import threading
import time
from multiprocessing.process import BaseProcess

from servelm.config import ConfigError, ServerArgs
from servelm.distributed.failures import PEER_LOST_EXIT_CODE, describe_exit, first_line, is_collective_failure

logger = logging.getLogger(__name__)

# How long rank 0 waits, once a TP collective failed or a worker exited as a mere witness
# (PEER_LOST_EXIT_CODE), for the rank that really died to be seen exiting. A killed process's
# sockets close as it exits, so on this node it is seen within milliseconds; the bound only
# matters when the dead rank is on another node (or there is none: a bug on rank 0).
_DEATH_GRACE_S = 5.0
# multiprocessing.util.Finalize priority of `TPWorkers.expect_exit`: any priority >= 0 runs
# before multiprocessing terminates the daemonic workers at exit.
_EXIT_PRIORITY = 10


def local_ranks(server_args: ServerArgs) -> range:
    """Global ranks hosted by this node (ranks are laid out node by node)."""
    if server_args.tp_size % server_args.nnodes:
        raise ConfigError(f"--tp-size ({server_args.tp_size}) must be a multiple of --nnodes ({server_args.nnodes})")
    per_node = server_args.tp_ranks_per_node
    return range(server_args.node_rank * per_node, (server_args.node_rank + 1) * per_node)


def with_dist_init_addr(server_args: ServerArgs) -> ServerArgs:
    """Fill in a free local rendezvous port for single-node TP; multi-node needs an explicit one."""
    if server_args.tp_size == 1 or server_args.dist_init_addr:
        return server_args
    if server_args.nnodes > 1:
        raise ConfigError("--dist-init-addr host:port is required with --nnodes > 1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return server_args.replace(dist_init_addr=f"127.0.0.1:{port}")


def _worker_main(server_args: ServerArgs, tp_rank: int, parent_pid: int) -> None:
    from servelm.managers.parent_watch import die_with_parent
    from servelm.model_executor.model_runner import ModelRunner, freeze_startup_heap

    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled by the parent
    logging.basicConfig(level=server_args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [TP{tp_rank}] %(name)s: %(message)s")
    from servelm.distributed.parallel_state import destroy_distributed

    try:
        runner = ModelRunner(server_args, tp_rank=tp_rank)
        freeze_startup_heap()
        runner.follow()
        destroy_distributed()  # pairs with rank 0's ModelRunner.shutdown()
    except Exception as exc:
        if is_collective_failure(exc):
            # Another rank died or stopped answering: rank 0 names it. One line, no traceback.
            logger.warning("stopping: a TP collective failed (%s)", first_line(exc))
            os._exit(PEER_LOST_EXIT_CODE)
        logger.error("TP rank %d failed: %s: %s", tp_rank, type(exc).__name__, exc, exc_info=True)
        os._exit(1)
    # A normal return (not os._exit) lets multiprocessing release this process's semaphores.


class TPWorkers:
    """The worker processes of this node, watched by a thread."""

    def __init__(self, server_args: ServerArgs, ranks: list[int]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.procs: dict[int, BaseProcess] = {}
        self._stopping = False
        self._report_lock = threading.Lock()
        self._report: str | None = None
        for rank in ranks:
            proc = ctx.Process(target=_worker_main, args=(server_args, rank, os.getpid()), daemon=True,
                               name=f"servelm-tp{rank}")
            proc.start()
            self.procs[rank] = proc
            logger.info("Started TP rank %d (pid %s)", rank, proc.pid)
        # At interpreter exit (or at the end of a multiprocessing child, such as the server's
        # scheduler process) multiprocessing terminates the daemonic workers: not a death.
        self._at_exit = multiprocessing.util.Finalize(self, self.expect_exit, exitpriority=_EXIT_PRIORITY)

    def watch(self, on_death: str = "exit") -> None:
        """Start a thread that ends this process when any worker dies unexpectedly."""
        sentinels = [proc.sentinel for proc in self.procs.values()]

        def run() -> None:
            multiprocessing.connection.wait(sentinels)  # returns when a worker has ended
            if self._stopping:
                return
            if self.report_death() is None and not self._stopping:
                # A sentinel fired, so a worker ended, but its exit code could not be read in time
                # (it was reaped elsewhere, or the machine is too busy to see it): still a death.
                logger.critical("A TP worker of this node ended unexpectedly; shutting down")
            if on_death == "exit" and not self._stopping:
                os._exit(1)

        if sentinels:
            threading.Thread(target=run, name="tp-watch", daemon=True).start()

    def report_death(self, grace_s: float = _DEATH_GRACE_S) -> str | None:
        """Name the worker whose death broke the TP group, in one line logged once per process.

        Returns that line (also to later callers), or None when no worker of this node ended
        within `grace_s` (the failure came from elsewhere) or their exit is expected. Workers
        that exited with PEER_LOST_EXIT_CODE only witnessed a death: the rank that died is
        preferred, and waited for up to `grace_s`.
        """
        with self._report_lock:
            if self._report is None and not self._stopping:
                found = self._find_dead_rank(grace_s)
                if found is None or self._stopping:
                    return None
                rank, code = found
                if code == PEER_LOST_EXIT_CODE:  # the rank that died is not on this node
                    self._report = f"TP rank {rank} lost its TP peers ({describe_exit(code)}); shutting down"
                else:
                    self._report = f"TP rank {rank} died ({describe_exit(code)}); shutting down"
                logger.critical("%s", self._report)
            return self._report

    def _find_dead_rank(self, grace_s: float) -> tuple[int, int] | None:
        """(rank, exit code) of the worker that died, waiting up to `grace_s` for one to end."""
        deadline = time.monotonic() + grace_s
        while True:
            # One read of each exit code (reading one reaps a zombie): a worker that became one between two
            # reads had been in neither `ended` nor `running`, and its death went unnamed
            codes = {rank: proc.exitcode for rank, proc in self.procs.items()}
            ended = {rank: code for rank, code in codes.items() if code is not None}
            culprits = sorted(rank for rank, code in ended.items() if code != PEER_LOST_EXIT_CODE)
            if culprits:
                return culprits[0], ended[culprits[0]]
            running = {self.procs[rank].sentinel: self.procs[rank] for rank, code in codes.items() if code is None}
            left = deadline - time.monotonic()
            if not running or left <= 0:
                if not ended:
                    return None
                witness = min(ended)
                return witness, ended[witness]
            for sentinel in multiprocessing.connection.wait(list(running), left):
                # The process closed its last descriptor, so it is exiting: reap it (its exit
                # code is only known once it is a zombie, a moment later).
                running[sentinel].join(max(0.0, deadline - time.monotonic()))

    def join_all(self) -> int:
        """Wait for every worker; returns the first non-zero exit code (0 when all ended cleanly)."""
        code = 0
        for proc in self.procs.values():
            proc.join()
            code = code or (proc.exitcode or 0)
        return code

    def expect_exit(self) -> None:
        """Workers are about to be told to exit: their exit is no longer a death."""
        self._stopping = True

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._at_exit.cancel()
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(1.0)
            if proc.is_alive():
                proc.kill()


def start_local_workers(server_args: ServerArgs) -> TPWorkers | None:
    """From rank 0's process: start this node's other ranks (rank 0 itself is the caller)."""
    if server_args.tp_size == 1:
        return None
    workers = TPWorkers(server_args, [r for r in local_ranks(server_args) if r != 0])
    workers.watch()
    return workers


def run_node_workers(server_args: ServerArgs) -> int:
    """`servelm serve --node-rank N` (N > 0): run this node's ranks until rank 0 shuts them down."""
    if not server_args.dist_init_addr:
        raise ConfigError("--dist-init-addr host:port is required with --nnodes > 1")
    ranks = list(local_ranks(server_args))
    logger.info("Node %d: starting TP ranks %s; rendezvous at %s", server_args.node_rank, ranks,
                server_args.dist_init_addr)
    workers = TPWorkers(server_args, ranks)
    try:
        return workers.join_all()
    finally:
        workers.stop(timeout=1.0)
