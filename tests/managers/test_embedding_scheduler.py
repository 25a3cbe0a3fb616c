"""The embedding scheduler without a model: inputs of many requests share a forward up to the token budget,
an input longer than the budget runs alone, aborts and bad inputs, a failing forward fails its batch only."""

from __future__ import annotations

import pytest

from servelm.managers.embedding_scheduler import EmbeddingScheduler
from servelm.managers.io_struct import GenerateReq


class FakeRunner:
    def __init__(self, fail: bool = False) -> None:
        self.batches: list[list[list[int]]] = []
        self.fail = fail

    def embed(self, seqs: list[list[int]], token_types: list[list[int]] | None = None) -> list[str]:
        if self.fail:
            raise RuntimeError("boom")
        self.batches.append(seqs)
        return [f"v{sum(s)}" for s in seqs]

    def model_info(self) -> dict:
        return {"task": "embed", "embedding_dimensions": 4}


def req(rid: str, n: int, start: int = 1) -> GenerateReq:
    return GenerateReq(rid=rid, input_ids=list(range(start, start + n)), sampling_params={})


def drain(s: EmbeddingScheduler) -> list:
    outs = []
    while s.has_work():
        outs += s.step()
    return outs


def test_inputs_of_many_requests_share_a_forward_up_to_the_budget() -> None:
    runner = FakeRunner()
    s = EmbeddingScheduler(runner, max_batch_tokens=25, max_context_len=40, vocab_size=100)
    for i in range(5):
        s.add_request(req(f"r{i}", 10))
    s.add_request(req("long", 40))  # longer than the budget: alone
    s.add_request(req("after", 3))
    outs = drain(s)
    assert [len(b) for b in runner.batches] == [2, 2, 1, 1, 1]
    assert [len(x) for x in runner.batches[3]] == [40]
    assert [o.rid for o in outs] == ["r0", "r1", "r2", "r3", "r4", "long", "after"]  # arrival order
    assert all(o.finish_reason.type == "stop" and o.embedding == f"v{sum(range(1, o.prompt_tokens + 1))}"
               for o in outs)
    assert outs[0].timings is not None and outs[0].completion_tokens == 0
    info = s.server_info()
    assert info["num_waiting"] == 0 and info["prompt_tokens_total"] == 93 and info["batches_total"] == 5


def test_max_inputs_per_forward() -> None:
    runner = FakeRunner()
    s = EmbeddingScheduler(runner, max_batch_tokens=10_000, max_context_len=40, vocab_size=100, max_batch_inputs=4)
    for i in range(10):
        s.add_request(req(f"r{i}", 2))
    drain(s)
    assert [len(b) for b in runner.batches] == [4, 4, 2]


def test_bad_inputs_are_refused_and_aborts_answer() -> None:
    s = EmbeddingScheduler(FakeRunner(), max_batch_tokens=100, max_context_len=8, vocab_size=100)
    with pytest.raises(ValueError, match=r"The input \(9 tokens\) is longer than the model's context length \(8"):
        s.add_request(req("x", 9))
    with pytest.raises(ValueError, match="out of"):
        s.add_request(GenerateReq(rid="y", input_ids=[5, 100], sampling_params={}))
    with pytest.raises(ValueError, match="at least one token"):
        s.add_request(GenerateReq(rid="z", input_ids=[], sampling_params={}))
    with pytest.raises(ValueError, match="does not generate"):
        s.add_request(GenerateReq(rid="g", input_ids=[5], sampling_params={"max_new_tokens": 16}))
    s.add_request(req("a", 8))  # exactly the limit fits: an embedding model's whole context is its input
    s.add_request(req("b", 3))
    outs = s.abort_request("a")
    assert [(o.rid, o.finish_reason.type, o.embedding) for o in outs] == [("a", "abort", None)]
    assert [o.rid for o in drain(s)] == ["b"] and not s.has_work()


def test_a_failing_forward_fails_its_batch_and_the_scheduler_goes_on() -> None:
    runner = FakeRunner(fail=True)
    s = EmbeddingScheduler(runner, max_batch_tokens=100, max_context_len=8, vocab_size=100)
    s.add_request(req("a", 3))
    (out,) = s.step()
    assert out.finish_reason.type == "abort" and out.finish_reason.internal and "boom" in out.finish_reason.message
    runner.fail = False
    s.add_request(req("b", 3))
    assert [o.embedding for o in s.step()] == ["v6"]
