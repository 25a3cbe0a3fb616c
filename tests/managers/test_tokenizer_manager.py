"""TokenizerManager request bookkeeping without a model: ids, duplicates, exact aborts, capacity.

A plain PULL socket stands in for the scheduler process and reads what the manager sends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from servelm.config import ServerArgs
from servelm.managers.io_struct import (
    AbortReq,
    BatchTokenOut,
    FinishReason,
    GenerateReq,
    TokenOut,
    decode,
    encode,
)
from servelm.managers.tokenizer_manager import CapacityError, DuplicateRequestIdError, TokenizerManager
from servelm.metrics import ServerMetrics
from servelm.sampling_params import SamplingParams


class FakeScheduler:
    """The scheduler's two sockets: reads the manager's messages, sends outputs back."""

    def __init__(self, to_addr: str, from_addr: str) -> None:
        self.ctx = zmq.Context()
        self.recv = self.ctx.socket(zmq.PULL)
        self.recv.connect(to_addr)
        self.send = self.ctx.socket(zmq.PUSH)
        self.send.setsockopt(zmq.LINGER, 0)
        self.send.connect(from_addr)

    def messages(self, timeout_ms: int = 2000) -> list[object]:
        out = []
        while self.recv.poll(timeout_ms):
            out.append(decode(self.recv.recv()))
            timeout_ms = 100
        return out

    def finish(self, rid: str, tokens: list[int]) -> None:
        self.send.send(encode(BatchTokenOut([TokenOut(
            rid=rid, token_ids=tokens, text="x" * len(tokens), prompt_tokens=3, completion_tokens=len(tokens),
            cached_tokens=0, finish_reason=FinishReason.length())])))

    def close(self) -> None:
        self.recv.close(0)
        self.send.close(0)
        self.ctx.term()


@pytest.fixture
def link(tmp_path: Path) -> Iterator[tuple[TokenizerManager, FakeScheduler]]:
    to_addr, from_addr = f"ipc://{tmp_path}/to", f"ipc://{tmp_path}/from"
    args = ServerArgs(max_running_requests=2, max_queued_requests=2)
    manager = TokenizerManager(args, to_addr, from_addr, ServerMetrics("m"))
    fake = FakeScheduler(to_addr, from_addr)
    yield manager, fake
    manager.close()
    fake.close()


def params(n: int = 1) -> SamplingParams:
    return SamplingParams(max_new_tokens=4, n=n)


def test_sub_request_ids_are_internal_and_collisions_are_refused(link: tuple[TokenizerManager, FakeScheduler]
                                                                 ) -> None:
    """A running `x-0`, then `x` with n=2 (whose choice 0 would be `x-0`): the second is refused."""
    manager, fake = link
    a = manager.submit([[1, 2, 3]], params(), "x-0", stream=False)
    with pytest.raises(DuplicateRequestIdError, match="'x-0'"):
        manager.submit([[1, 2, 3]], params(n=2), "x", stream=False)
    with pytest.raises(DuplicateRequestIdError, match="'x-0'"):
        manager.submit([[1, 2, 3]], params(), "x-0", stream=False)
    sent = fake.messages()
    assert len(sent) == 1 and isinstance(sent[0], GenerateReq)
    # The scheduler's id is the manager's own, never the client's text.
    assert sent[0].rid == a.subs[0].rid != "x-0" and a.subs[0].public_id == "x-0"
    assert manager.num_in_flight == 1


def test_ids_of_a_group_and_exact_abort(link: tuple[TokenizerManager, FakeScheduler]) -> None:
    manager, fake = link
    group = manager.submit([[1, 2, 3]], params(n=2), "y", stream=False)
    other = manager.submit([[4, 5]], params(), "y-", stream=False)  # a prefix of y's sub ids, not one of them
    assert [s.public_id for s in group.subs] == ["y-0", "y-1"]
    assert len({s.rid for s in group.subs} | {other.subs[0].rid}) == 3
    fake.messages()
    assert manager.abort_request("y-1") is True  # one sub-request, exactly
    assert [m.rid for m in fake.messages()] == [group.subs[1].rid]
    assert manager.abort_request("y") is True  # the whole group: both its (unfinished) subs
    assert sorted(m.rid for m in fake.messages()) == sorted(s.rid for s in group.subs)
    assert manager.abort_request("nope") is False and manager.abort_request("y-2") is False
    assert manager.abort_request("y-") is True
    msgs = fake.messages()
    assert all(isinstance(m, AbortReq) for m in msgs) and [m.rid for m in msgs] == [other.subs[0].rid]


def test_finished_ids_are_free_again_and_nothing_leaks(link: tuple[TokenizerManager, FakeScheduler]) -> None:
    manager, fake = link

    async def run() -> list[int]:
        manager.start()
        group = manager.submit([[1, 2, 3]], params(n=2), "z", stream=False)
        for sub in group.subs:
            fake.finish(sub.rid, [7, 8])
        got = [out.token_ids async for _, out in group.outputs()]
        return [len(g) for g in got]

    assert asyncio.run(run()) == [2, 2]
    assert manager.num_in_flight == 0 and not manager._public and not manager._subs
    manager.submit([[1]], params(), "z-0", stream=False)  # no longer in use
    manager.submit([[1]], params(), "z", stream=False)


def test_a_group_that_can_never_fit_is_not_a_retry_later(link: tuple[TokenizerManager, FakeScheduler]) -> None:
    manager, fake = link
    with pytest.raises(CapacityError, match="at most 4"):
        manager.submit([[1, 2]], params(n=5), "big", stream=False)
    assert manager.num_in_flight == 0 and fake.messages(timeout_ms=100) == []
