"""Rendezvous, warm-up and the memory-balance check over real gloo worlds of 2 and 4."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
from distributed_harness import World, free_port

from servelm.distributed import startup
from servelm.distributed.communicator import tensor_model_parallel_all_reduce
from servelm.distributed.parallel_state import (
    broadcast_object,
    destroy_distributed,
    get_tp_group,
    get_tp_rank,
    get_tp_size,
    init_distributed,
    parse_dist_init_addr,
)

pytestmark = pytest.mark.slow  # starts servers, spawns ranks or loads the default model

UNBALANCED = ("The memory capacity is unbalanced. Some devices may be occupied by other processes. "
              "min={} local={}")


@pytest.fixture(scope="module", params=[2, 4])
def world(request: pytest.FixtureRequest) -> World:
    with World(request.param) as w:
        yield w


class Grab(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelno, record.getMessage()))


def _with_logs(fn, *args) -> tuple[object, list[tuple[int, str]]]:  # type: ignore[no-untyped-def]
    grab = Grab()
    log = logging.getLogger("servelm.distributed")
    old_level = log.level
    log.addHandler(grab)
    log.setLevel(logging.DEBUG)
    try:
        try:
            result: object = fn(*args)
        except RuntimeError as err:
            result = err
        return result, grab.records
    finally:
        log.removeHandler(grab)
        log.setLevel(old_level)


def _state() -> dict:
    g = get_tp_group()
    return {"rank": get_tp_rank(), "size": get_tp_size(), "backend": g.backend,
            "device_backend": str(dist.get_backend(g.device_group)), "cpu_backend": str(dist.get_backend(g.cpu_group)),
            "distinct": g.cpu_group is not g.device_group, "local_ranks": startup.local_rank_count()}


def _warmup() -> tuple:
    return _with_logs(startup.warmup_all_reduce)


def _balance(strict: bool, starve_rank: int | None) -> dict:
    g = get_tp_group()
    real = startup.get_local_free_memory
    if g.rank == starve_rank:
        startup.get_local_free_memory = lambda device, ranks_on_host=1: real(device, ranks_on_host) // 2
    try:
        result, logs = _with_logs(startup.check_memory_balance, strict)
        local = startup.get_local_free_memory(g.device, startup.local_rank_count())
    finally:
        startup.get_local_free_memory = real
    return {"result": result if not isinstance(result, RuntimeError) else str(result), "raised":
            isinstance(result, RuntimeError), "logs": logs, "local": local}


def _startup_all() -> tuple:
    return _with_logs(startup.run_startup_checks, False, True)


def test_init_distributed_builds_a_gloo_device_group_and_a_gloo_cpu_group(world: World) -> None:
    ws = world.world_size
    for rank, s in enumerate(world.run(_state)):
        assert s == {"rank": rank, "size": ws, "backend": "gloo", "device_backend": "gloo", "cpu_backend": "gloo",
                     "distinct": True, "local_ranks": ws}


def test_warmup_all_reduce_is_timed_and_logged(world: World) -> None:
    for seconds, logs in world.run(_warmup):
        assert isinstance(seconds, float) and seconds > 0
        assert any(level == logging.INFO and msg.startswith(f"TP warm-up all-reduce (gloo, {world.world_size} ranks)")
                   for level, msg in logs), logs


def test_balanced_memory_returns_the_same_minimum_everywhere(world: World) -> None:
    res = world.run(_balance, True, None)
    assert len({r["result"] for r in res}) == 1
    for r in res:
        assert not r["raised"] and r["logs"] == []
        # Each rank's share of the host: available RAM / ranks on this host, within 10% of each other.
        assert 0.9 * r["local"] <= r["result"] <= 1.1 * r["local"]


def test_unbalanced_memory_logs_on_the_rich_ranks(world: World) -> None:
    res = world.run(_balance, False, 1)
    minimum = res[0]["result"]
    assert all(r["result"] == minimum and not r["raised"] for r in res)
    for rank, r in enumerate(res):
        if rank == 1:
            assert r["logs"] == []  # its own value is the minimum
        else:
            (level, msg), = r["logs"]
            assert level == logging.WARNING
            local = int(msg.rsplit("local=", 1)[1])
            assert msg == UNBALANCED.format(minimum, local)
            assert minimum < 0.9 * local


def test_unbalanced_memory_strict_raises(world: World) -> None:
    res = world.run(_balance, True, 1)
    assert not res[1]["raised"]
    minimum = res[1]["result"]
    for rank, r in enumerate(res):
        if rank != 1:
            assert r["raised"]
            local = int(r["result"].rsplit("local=", 1)[1])
            assert r["result"] == UNBALANCED.format(minimum, local)


def test_run_startup_checks_with_the_all_to_all_warmup(world: World) -> None:
    res = world.run(_startup_all)
    assert len({minimum for minimum, _ in res}) == 1
    for _, logs in res:
        messages = [m for _, m in logs]
        assert any(m.startswith("TP warm-up all-reduce") for m in messages)
        assert any(m.startswith("LM-head all-to-all warm-up: 4 MiB per peer") for m in messages)


def test_world_of_one_rendezvous_and_destroy() -> None:
    group = init_distributed(1, 0, f"127.0.0.1:{free_port()}", timeout_s=30)
    try:
        assert dist.is_initialized() and get_tp_group() is group and group.world_size == 1
        assert startup.check_memory_balance(strict=True) > 0
        assert startup.warmup_all_reduce() == 0.0
    finally:
        destroy_distributed()
    assert not dist.is_initialized() and get_tp_size() == 1 and get_tp_group().device_group is None


@pytest.mark.parametrize("addr", ["localhost", "host:", ":123", "host:port", "host:70000"])
def test_bad_dist_init_addr(addr: str) -> None:
    with pytest.raises(ValueError, match="--dist-init-addr must be host:port"):
        parse_dist_init_addr(addr)


def test_parse_dist_init_addr() -> None:
    assert parse_dist_init_addr("10.0.0.1:5000") == ("10.0.0.1", 5000)
    assert parse_dist_init_addr("[::1]:5000") == ("[::1]", 5000)
    assert parse_dist_init_addr(f"{socket.gethostname()}:1") == (socket.gethostname(), 1)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"tp_size": 2, "tp_rank": 2}, r"tp_rank must be in \[0, 2\)"),
    ({"tp_size": 3, "tp_rank": 0, "nnodes": 2}, r"--tp-size \(3\) must be a multiple of --nnodes \(2\)"),
    ({"tp_size": 4, "tp_rank": 1, "nnodes": 2, "node_rank": 1}, "rank 1 does not live on node 1"),
])
def test_init_distributed_validates_layout(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        init_distributed(dist_init_addr="127.0.0.1:1", **kwargs)


def _dying_rank(rank: int, addr: str, out: object) -> None:
    init_distributed(2, rank, addr, timeout_s=60)
    broadcast_object("in step")
    if rank == 1:
        os._exit(3)  # a crashed rank: no clean-up, sockets closed by the OS
    time.sleep(0.3)
    outcome = []
    for call in (lambda: tensor_model_parallel_all_reduce(torch.ones(4)), lambda: broadcast_object("next step")):
        t0 = time.monotonic()
        try:
            call()
            outcome.append(("no error", time.monotonic() - t0))
        except RuntimeError as err:
            outcome.append((str(err), time.monotonic() - t0))
    destroy_distributed()  # its barrier fails fast too: no hang on the way out
    out.put(outcome)  # type: ignore[attr-defined]


def test_a_dead_peer_makes_collectives_fail_fast_not_hang() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_dying_rank, args=(r, addr, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        outcome = out.get(timeout=30)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 3]
    for message, seconds in outcome:  # both the device group and the CPU group notice at once
        assert "Connection closed by peer" in message and seconds < 5, (message, seconds)
