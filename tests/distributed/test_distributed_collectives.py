"""All-reduce paths over real gloo worlds of 2, 3, 4 and 6 processes: plain, deterministic, quick, fallback."""

from __future__ import annotations

import logging

import pytest
import torch
from distributed_harness import World

from servelm.distributed import communicator as comm
from servelm.distributed.parallel_state import TPGroup, broadcast_object, get_tp_group
from servelm.distributed.quick_allreduce import error_bound

pytestmark = pytest.mark.slow  # starts servers, spawns ranks or loads the default model

WARNING = "Quick allreduce is disabled due to an unsupported world size: {}. Supported world sizes: [2, 4, 8]."


@pytest.fixture(scope="module", params=[2, 4])
def world(request: pytest.FixtureRequest) -> World:
    with World(request.param) as w:
        yield w


def rank_data(rank: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rank `rank`'s input; the parent rebuilds every rank's input with the same call."""
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(shape, generator=gen)
    # Magnitudes spanning ~3 decades across blocks, so per-block scales matter.
    x = x * torch.exp(2 * torch.randn(shape, generator=gen).clamp(-2, 2))
    return x.to(dtype)


def exact_sum(ws: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.stack([rank_data(r, shape, dtype, seed).double() for r in range(ws)]).sum(0)


def rank_order_fp32_sum(ws: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    acc = rank_data(0, shape, dtype, seed).float()
    for r in range(1, ws):
        acc = acc + rank_data(r, shape, dtype, seed).float()
    return acc.to(dtype)


# ---- tasks (run on every rank) ------------------------------------------------------------------------


def _plain(shape: tuple[int, ...]) -> dict:
    comm.configure_all_reduce("none")
    comm.reset_all_reduce_stats()
    g = get_tp_group()
    ints = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (g.rank + 1)
    x = rank_data(g.rank, shape, torch.float32)
    return {"ints": comm.tensor_model_parallel_all_reduce(ints), "rand": comm.tensor_model_parallel_all_reduce(x),
            "stats": comm.all_reduce_stats()}


def _deterministic(shape: tuple[int, ...], dtype: torch.dtype) -> dict:
    comm.configure_all_reduce("int8", min_bytes=0, deterministic=True)  # deterministic wins over quick
    comm.reset_all_reduce_stats()
    g = get_tp_group()
    x = rank_data(g.rank, shape, dtype)
    before = x.clone()
    full = comm.tensor_model_parallel_all_reduce(x)
    # The same rows reduced in uneven chunks, one by one, and inside a different, bigger batch
    # (rows shuffled among unrelated ones): the spec's "independent of batch size and chunking".
    chunks = torch.cat([comm.tensor_model_parallel_all_reduce(x[a:b].clone())
                        for a, b in [(0, 1), (1, 4), (4, 11), (11, shape[0])]])
    singles = torch.stack([comm.tensor_model_parallel_all_reduce(x[i].clone()) for i in range(shape[0])])
    cols = torch.cat([comm.tensor_model_parallel_all_reduce(x[:, :5].contiguous()),
                      comm.tensor_model_parallel_all_reduce(x[:, 5:].contiguous())], dim=1)
    perm = torch.randperm(3 * shape[0], generator=torch.Generator().manual_seed(7))
    big = torch.cat([x, rank_data(g.rank, (2 * shape[0], *shape[1:]), dtype, seed=9)])[perm]
    big_out = comm.tensor_model_parallel_all_reduce(big)
    embedded = big_out[torch.argsort(perm)][: shape[0]]
    return {"full": full, "chunks": chunks, "singles": singles, "cols": cols, "embedded": embedded,
            "unchanged": torch.equal(x, before), "stats": comm.all_reduce_stats()}


def _row_by_row(deterministic: bool) -> int:
    """How many elements differ between reducing a [64, 257] batch at once and row by row."""
    comm.configure_all_reduce("none", deterministic=deterministic)
    x = rank_data(get_tp_group().rank, (64, 257), torch.float32)
    full = comm.tensor_model_parallel_all_reduce(x.clone())
    rows = torch.stack([comm.tensor_model_parallel_all_reduce(x[i].clone()) for i in range(64)])
    return int((full != rows).sum())


def _dtype_errors() -> list[str]:
    comm.configure_all_reduce("none", deterministic=True)
    msgs = []
    for dtype in (torch.int32, torch.int64, torch.float64):
        try:
            comm.tensor_model_parallel_all_reduce(torch.ones(4, dtype=dtype))
            msgs.append("no error")
        except RuntimeError as err:
            msgs.append(str(err))
    return msgs


def _quick(n: int, dtype: torch.dtype) -> dict:
    g = get_tp_group()
    x = rank_data(g.rank, (n,), dtype)
    out = {}
    for mode in ("fp", "int8", "int6", "int4"):
        comm.configure_all_reduce(mode, min_bytes=0)
        comm.reset_all_reduce_stats()
        before = x.clone()
        out[mode] = comm.tensor_model_parallel_all_reduce(x)
        out[mode + "_stats"] = comm.all_reduce_stats()
        out[mode + "_unchanged"] = torch.equal(x, before)
    return out


def _eligibility() -> dict:
    g = get_tp_group()
    cfg = comm.configure_all_reduce("int8", min_bytes=4096)
    cases = {
        "fp32_at_min": torch.ones(1024),  # 4096 bytes
        "fp32_below_min": torch.ones(1023),
        "bf16_at_min": torch.ones(2048, dtype=torch.bfloat16),
        "fp16_below_min": torch.ones(2047, dtype=torch.float16),
        "int32_big": torch.ones(4096, dtype=torch.int32),
        "int64_big": torch.ones(4096, dtype=torch.int64),
    }
    paths, values = {}, {}
    for name, t in cases.items():
        comm.reset_all_reduce_stats()
        t = t * (g.rank + 1)
        values[name] = comm.tensor_model_parallel_all_reduce(t)
        paths[name] = next(iter(comm.all_reduce_stats()))
    comm.configure_all_reduce("none", min_bytes=0)
    comm.reset_all_reduce_stats()
    comm.tensor_model_parallel_all_reduce(torch.ones(1 << 16))
    paths["mode_none"] = next(iter(comm.all_reduce_stats()))
    # Plain path reduces in place and returns its input; quick leaves the input alone.
    comm.configure_all_reduce("int8", min_bytes=4096)
    small, big = torch.ones(4), torch.ones(2048)
    small_out, big_out = comm.tensor_model_parallel_all_reduce(small), comm.tensor_model_parallel_all_reduce(big)
    return {"config": cfg, "paths": paths, "values": values, "plain_in_place": small_out is small,
            "quick_new": big_out is not big and torch.equal(big, torch.ones(2048))}


def _unsupported_world(n: int) -> dict:
    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Grab(level=logging.WARNING)
    logging.getLogger("servelm.distributed.communicator").addHandler(handler)
    try:
        cfg = comm.configure_all_reduce("int4", min_bytes=0)
    finally:
        logging.getLogger("servelm.distributed.communicator").removeHandler(handler)
    comm.reset_all_reduce_stats()
    g = get_tp_group()
    ints = torch.arange(n, dtype=torch.float32) * (g.rank + 1)
    return {"config": cfg, "warnings": records, "out": comm.tensor_model_parallel_all_reduce(ints),
            "stats": comm.all_reduce_stats()}


def _broadcast(src: int) -> list:
    g = get_tp_group()
    small = {"step": 3, "rids": ["a", "b"], "tokens": [1, 2, 3]} if g.rank == src else None
    large = list(range(50_000)) if g.rank == src else "ignored"
    edge = b"x" * (4096 - 8 - 50) if g.rank == src else None  # pickle just around the inline size
    return [broadcast_object(small, src=src), broadcast_object(large, src=src) == list(range(50_000)),
            broadcast_object(edge, src=src) == b"x" * (4096 - 8 - 50), broadcast_object(None, src=src)]


def _all_gather() -> torch.Tensor:
    g = get_tp_group()
    return comm.tensor_model_parallel_all_gather(torch.full((2, 3), float(g.rank)), dim=-1)


# ---- tests --------------------------------------------------------------------------------------------


def test_world_of_one_is_identity() -> None:
    old = get_tp_group()
    try:
        from servelm.distributed.parallel_state import set_tp_group

        set_tp_group(TPGroup())
        comm.configure_all_reduce("int8", min_bytes=0, deterministic=True)
        comm.reset_all_reduce_stats()
        x = torch.randn(8)
        assert comm.tensor_model_parallel_all_reduce(x) is x
        assert comm.all_reduce_stats() == {"identity": 1}
        assert broadcast_object({"a": 1}) == {"a": 1}
    finally:
        set_tp_group(old)


def test_configure_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="--quick-allreduce"):
        comm.configure_all_reduce("int3", group=TPGroup())


@pytest.mark.parametrize("ws", [1, 2, 3, 4, 5, 6, 7, 8, 16])
def test_configure_world_size_rule(ws: int, caplog: pytest.LogCaptureFixture) -> None:
    group = TPGroup(world_size=ws)
    with caplog.at_level(logging.WARNING, logger="servelm.distributed.communicator"):
        cfg = comm.configure_all_reduce("fp", min_bytes=123, deterministic=False, group=group)
    supported = ws in (1, 2, 4, 8)  # a world of one never reduces: nothing to warn about
    assert cfg == group.all_reduce_config
    assert (cfg.mode, cfg.min_bytes, cfg.quick_mode) == ("fp", 123, "fp" if supported else "none")
    assert caplog.messages == ([] if supported else [WARNING.format(ws)])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="servelm.distributed.communicator"):
        assert comm.configure_all_reduce("none", group=group).quick_mode == "none"
    assert caplog.messages == []


def test_plain_all_reduce_exact(world: World) -> None:
    ws = world.world_size
    res = world.run(_plain, (64, 33))
    ints = torch.arange(12, dtype=torch.float32).reshape(3, 4) * sum(range(1, ws + 1))
    for r in res:
        assert torch.equal(r["ints"], ints)
        assert r["stats"] == {"plain": 2}
        torch.testing.assert_close(r["rand"].double(), exact_sum(ws, (64, 33), torch.float32), rtol=1e-6, atol=1e-5)
        assert torch.equal(r["rand"], res[0]["rand"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_deterministic_bit_identical_and_batch_invariant(world: World, dtype: torch.dtype) -> None:
    ws, shape = world.world_size, (16, 37)
    res = world.run(_deterministic, shape, dtype)
    expected = rank_order_fp32_sum(ws, shape, dtype)
    for r in res:
        assert r["stats"] == {"deterministic": 1 + 4 + 16 + 2 + 1}  # full, chunks, rows, col halves, big
        assert r["unchanged"]
        assert r["full"].dtype == dtype
        # bit-identical on every rank and to fp32 rank-order accumulation
        assert torch.equal(r["full"].view(torch.uint8 if dtype != torch.float32 else torch.int32).flatten(),
                           res[0]["full"].view(torch.uint8 if dtype != torch.float32 else torch.int32).flatten())
        assert torch.equal(r["full"], expected)
        for key in ("chunks", "singles", "cols", "embedded"):
            assert torch.equal(r[key], r["full"]), key


def test_plain_gloo_is_not_batch_invariant_at_4_ranks_but_deterministic_is(world: World) -> None:
    # With 2 ranks a + b == b + a, so any all-reduce is invariant; from 3 ranks on, gloo's ring sums an
    # element in an order that depends on where it falls in the message (measured: ~1/3 of elements differ).
    if world.world_size == 4:
        assert all(n > 0 for n in world.run(_row_by_row, False))
    assert world.run(_row_by_row, True) == [0] * world.world_size


def test_deterministic_rejects_other_dtypes(world: World) -> None:
    for msgs in world.run(_dtype_errors):
        assert msgs == [f"deterministic all-reduce only supports float32, float16 and bfloat16, got {d}"
                        for d in ("torch.int32", "torch.int64", "torch.float64")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quick_all_reduce_within_derived_bound(world: World, dtype: torch.dtype) -> None:
    ws, n = world.world_size, 5000 + 7  # not a multiple of ws * 32: exercises the padding
    res = world.run(_quick, n, dtype)
    inputs = [rank_data(r, (n,), dtype) for r in range(ws)]
    exact = exact_sum(ws, (n,), dtype)
    mean_err = {}
    for mode in ("fp", "int8", "int6", "int4"):
        for r in res:
            assert r[mode + "_stats"] == {"quick": 1}
            assert r[mode + "_unchanged"]
            assert r[mode].dtype == dtype and r[mode].shape == (n,)
            assert torch.equal(r[mode], res[0][mode]), f"{mode}: ranks disagree"
        out = res[0][mode].double()
        err = (out - exact).abs()
        bound = error_bound(inputs, mode)
        worst = (err / bound.clamp_min(1e-30)).max().item()
        assert (err <= bound).all(), f"{mode}: error {err.max().item()} exceeds bound (ratio {worst:.3f})"
        mean_err[mode] = err.mean().item()
        if mode == "fp":
            # no quantisation: exactly the fp32 sum in rank order, cast back
            assert torch.equal(res[0][mode], rank_order_fp32_sum(ws, (n,), dtype))
        else:
            # the bound is not vacuous: real quantisation happened and came within reach of it
            assert worst > 0.2, f"{mode}: worst error only {worst:.3f} of the bound"
    assert mean_err["fp"] < mean_err["int8"] < mean_err["int6"] < mean_err["int4"]


def test_quick_all_reduce_eligibility(world: World) -> None:
    ws = world.world_size
    tri = sum(range(1, ws + 1))
    for r in world.run(_eligibility):
        assert r["config"].quick_mode == "int8"
        assert r["paths"] == {"fp32_at_min": "quick", "fp32_below_min": "plain", "bf16_at_min": "quick",
                              "fp16_below_min": "plain", "int32_big": "plain", "int64_big": "plain",
                              "mode_none": "plain"}
        for name in ("int32_big", "int64_big", "fp32_below_min", "fp16_below_min"):
            assert torch.equal(r["values"][name], torch.full_like(r["values"][name], tri))
        assert r["plain_in_place"] and r["quick_new"]


@pytest.mark.parametrize("ws", [3, 6])
def test_quick_all_reduce_falls_back_on_unsupported_world_size(ws: int) -> None:
    with World(ws) as w:
        res = w.run(_unsupported_world, 1 << 12)
    for r in res:
        assert r["warnings"] == [WARNING.format(ws)]
        assert r["config"].mode == "int4" and r["config"].quick_mode == "none"
        assert r["stats"] == {"plain": 1}
        assert torch.equal(r["out"], torch.arange(1 << 12, dtype=torch.float32) * sum(range(1, ws + 1)))


def test_supported_world_size_does_not_warn(world: World) -> None:
    for r in world.run(_unsupported_world, 1 << 12):
        assert r["warnings"] == [] and r["config"].quick_mode == "int4" and r["stats"] == {"quick": 1}


@pytest.mark.parametrize("src", [0, 1])
def test_broadcast_object(world: World, src: int) -> None:
    for r in world.run(_broadcast, src):
        assert r == [{"step": 3, "rids": ["a", "b"], "tokens": [1, 2, 3]}, True, True, None]


def test_all_gather_concatenates_in_rank_order(world: World) -> None:
    ws = world.world_size
    expected = torch.cat([torch.full((2, 3), float(r)) for r in range(ws)], dim=-1)
    for r in world.run(_all_gather):
        assert torch.equal(r, expected)
