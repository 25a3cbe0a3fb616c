"""LM-head all-to-all over real gloo worlds of 2 and 4: reassembly equals the all-gather path."""

from __future__ import annotations

import pytest
import torch
from distributed_harness import World

from servelm.distributed.communicator import tensor_model_parallel_all_gather
from servelm.distributed.lm_head_all_to_all import (
    can_use_all_to_all,
    gather_sampled_tokens,
    lm_head_all_to_all,
    my_rows,
    warmup_all_to_all,
)
from servelm.distributed.parallel_state import TPGroup, get_tp_group

pytestmark = pytest.mark.slow  # starts servers, spawns ranks or loads the default model

A2A_ERROR = ("--enable-tp-lm-head-all-to-all requires a communicator that supports all-to-all "
             "(got backend fake).")


@pytest.fixture(scope="module", params=[2, 4])
def world(request: pytest.FixtureRequest) -> World:
    with World(request.param) as w:
        yield w


class FakeGroup:
    """A process group whose backend cannot all-to-all (what `dist.all_to_all_single` calls into)."""

    def name(self) -> str:
        return "fake"

    def all_to_all_single(self, *args: object) -> None:
        raise RuntimeError("fake backend does not support alltoall")


def full_logits(rows: int, vocab: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows * 31 + vocab))


def _reassemble(rows: int, vocab: int) -> dict:
    g = get_tp_group()
    shard = vocab // g.world_size
    local = full_logits(rows, vocab)[:, g.rank * shard:(g.rank + 1) * shard].clone()  # vocab-parallel head
    gathered = tensor_model_parallel_all_gather(local, dim=-1)  # the fallback path: [rows, V]
    out: dict = {"can": can_use_all_to_all(rows), "gathered": gathered}
    if out["can"]:
        mine = lm_head_all_to_all(local)
        out["mine"] = mine
        out["rows"] = my_rows(rows)
        out["ids"] = gather_sampled_tokens(mine.argmax(dim=-1))
        out["logprobs"] = gather_sampled_tokens(torch.log_softmax(mine, -1).max(-1).values[:, None])
    else:
        try:
            lm_head_all_to_all(local)
            out["error"] = None
        except ValueError as err:
            out["error"] = str(err)
    return out


def _warmup() -> float:
    return warmup_all_to_all()


def _fake_in_world() -> str:
    g = get_tp_group()
    fake = TPGroup(rank=g.rank, world_size=g.world_size, device_group=FakeGroup(), cpu_group=g.cpu_group)
    try:
        warmup_all_to_all(fake, bytes_per_peer=1024)
    except RuntimeError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("rows", [8, 12])
def test_all_to_all_reassembly_equals_all_gather(world: World, rows: int) -> None:
    ws, vocab = world.world_size, 40 * world.world_size
    full = full_logits(rows, vocab)
    res = world.run(_reassemble, rows, vocab)
    for rank, r in enumerate(res):
        assert r["can"]
        assert torch.equal(r["gathered"], full)
        assert r["rows"] == range(rank * rows // ws, (rank + 1) * rows // ws)
        assert r["mine"].shape == (rows // ws, vocab)
        assert torch.equal(r["mine"], r["gathered"][r["rows"].start:r["rows"].stop])
        assert torch.equal(r["ids"], full.argmax(-1))
        assert torch.equal(r["logprobs"], torch.log_softmax(full, -1).max(-1).values[:, None])


def test_rows_not_divisible_fall_back_to_all_gather(world: World) -> None:
    ws, rows, vocab = world.world_size, 4 * world.world_size + 1, 16 * world.world_size
    full = full_logits(rows, vocab)
    for r in world.run(_reassemble, rows, vocab):
        assert not r["can"]
        assert torch.equal(r["gathered"], full)
        assert r["error"] == (f"lm_head_all_to_all needs rows divisible by tp ({rows} rows, tp={ws}); "
                              "use the all-gather path")


def test_warmup_all_to_all_on_gloo(world: World) -> None:
    for seconds in world.run(_warmup):
        assert seconds > 0


def test_fake_group_without_all_to_all_stops_with_the_spec_error(world: World) -> None:
    assert world.run(_fake_in_world) == [A2A_ERROR] * world.world_size


def test_fake_group_error_without_a_process_group() -> None:
    fake = TPGroup(rank=0, world_size=2, device_group=FakeGroup())
    with pytest.raises(RuntimeError) as info:
        warmup_all_to_all(fake, bytes_per_peer=16)
    assert str(info.value) == A2A_ERROR
    assert "fake backend does not support alltoall" in str(info.value.__cause__)


def test_world_of_one_passes_through() -> None:
    g = TPGroup()
    x = torch.randn(3, 10)
    assert can_use_all_to_all(3, g)
    assert lm_head_all_to_all(x, g) is x
    assert gather_sampled_tokens(x, g) is x
    assert warmup_all_to_all(g) == 0.0
