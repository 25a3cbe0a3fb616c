"""Scheduler + KV bookkeeping with no model: a fake runner whose "model" reads tokens back from the KV slots.

The fake stores each computed token id in its slot and predicts the next token from the tokens it READS
BACK through kv_indices. Any bookkeeping error (wrong slot, a page shared or freed too early, a bad prefix
match) changes what it reads and therefore the output, so comparing against the true sequence catches it.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from servelm.layers.sampler import sample
from servelm.managers.io_struct import FinishReason, GenerateReq
from servelm.managers.schedule_batch import SampleOutput, StepInput
from servelm.managers.scheduler import Scheduler, SchedulerConfig
from servelm.model_executor.forward_batch import ForwardBatch

VOCAB = 64
EOS = 0


def next_token(seq: list[int]) -> int:
    return 1 + zlib.crc32(bytes(t % 256 for t in seq)) % (VOCAB - 1)


class FakeTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids if not (skip_special_tokens and t == EOS))


class FakeRunner:
    def __init__(self, num_slots: int) -> None:
        self.slot_token = [-1] * num_slots
        self.max_batch = 0

    def execute(self, step: StepInput) -> SampleOutput | None:
        logits = self.forward(ForwardBatch.from_step(step, torch.device("cpu")))
        return sample(logits, step.sample_rows) if step.sample_rows else None

    def forward(self, fb) -> torch.Tensor:
        for slot, tok in zip(fb.out_cache_loc.tolist(), fb.input_ids.tolist()):
            self.slot_token[slot] = tok
        self.max_batch = max(self.max_batch, len(fb.extend_lens))
        rows, start = [], 0
        for n, kv in zip(fb.extend_lens, fb.kv_indices):
            seen = [self.slot_token[s] for s in kv.tolist()]
            for j in range(n):
                rows.append(next_token(seen[: len(seen) - n + j + 1]))
            start += n
        logits = torch.full((len(rows), VOCAB), -10.0)
        logits[torch.arange(len(rows)), torch.tensor(rows)] = 10.0
        return logits[fb.logits_indices]


def make(num_pages: int = 1000, page_size: int = 1, **kw) -> Scheduler:
    cfg = SchedulerConfig(num_pages=num_pages, page_size=page_size, max_context_len=10_000, **kw)
    return Scheduler(FakeRunner(num_pages * page_size), FakeTokenizer(), cfg, [EOS], VOCAB)


def expected_output(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


def run_all(s: Scheduler, reqs: list[GenerateReq]) -> dict[str, list[int]]:
    for r in reqs:
        s.add_request(r)
    out: dict[str, list[int]] = {r.rid: [] for r in reqs}
    steps = 0
    while s.has_work():
        for o in s.step():
            out[o.rid] += o.token_ids
        s.check_integrity()
        steps += 1
        assert steps < 10_000
    assert s.allocator.num_free_pages + s.cache.cached_pages == s.allocator.num_pages
    return out


def gen_req(rid: str, prompt: list[int], n: int, **sp) -> GenerateReq:
    return GenerateReq(rid, prompt, {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **sp})


def prompts(count: int, seed: int = 0, lo: int = 1, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("chunk", [3, 16, 512])
@pytest.mark.parametrize("radix", [True, False])
def test_outputs_independent_of_chunking_paging_and_cache(page_size: int, chunk: int, radix: bool) -> None:
    ps = prompts(12, seed=page_size + chunk)
    ps += [ps[0] + [5, 6, 7], ps[1][:3]]  # shared prefixes
    s = make(page_size=page_size, chunked_prefill_size=chunk, disable_radix_cache=not radix)
    out = run_all(s, [gen_req(f"r{i}", p, 9) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert out[f"r{i}"] == expected_output(p, 9)


def test_prefix_cache_hit_reports_cached_tokens_and_same_output() -> None:
    s = make(page_size=4)
    p = list(range(1, 30))
    first = run_all(s, [gen_req("a", p, 5)])
    s.add_request(gen_req("b", p + [7, 8], 5))
    outs = []
    while s.has_work():
        outs += s.step()
    assert outs[-1].cached_tokens == 28  # page aligned part of the 34 tokens cached by "a"
    assert first["a"] == expected_output(p, 5)
    assert sum((o.token_ids for o in outs), []) == expected_output(p + [7, 8], 5)
    assert s.cache.hit_rate > 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_running_request_shares_its_prefilled_prefix(page_size: int) -> None:
    """A prompt's KV enters the prefix cache as soon as it is prefilled: a request arriving while the first
    one still decodes reuses it (and the first one's duplicate of a racing prefix is freed)."""
    s = make(page_size=page_size, chunked_prefill_size=8)
    system = list(range(1, 30))
    s.add_request(gen_req("a", system + [40], 50))
    s.add_request(gen_req("twin", system + [41], 50))  # same step as "a": computes the prefix too
    while any(r.num_computed < len(r.prompt_ids) for r in s.running) or s.waiting:
        s.step()
        s.check_integrity()
    assert all(len(r.output_ids) < 50 for r in s.running)  # both still running
    s.add_request(gen_req("b", system + [42, 43], 5))
    out = {"a": [], "twin": [], "b": []}
    cached = {}
    while s.has_work():
        for o in s.step():
            out[o.rid] += o.token_ids
            cached[o.rid] = o.cached_tokens
        s.check_integrity()
    assert cached["b"] == 29 // page_size * page_size
    assert out["b"] == expected_output(system + [42, 43], 5)
    assert out["a"] == expected_output(system + [40], 50) and out["twin"] == expected_output(system + [41], 50)
    assert s.in_use_pages() == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_under_tiny_pool_keeps_outputs_correct(page_size: int) -> None:
    ps = prompts(8, seed=3, lo=10, hi=20)
    s = make(num_pages=60 // page_size + 2, page_size=page_size, chunked_prefill_size=64)
    out = run_all(s, [gen_req(f"r{i}", p, 25) for i, p in enumerate(ps)])
    assert s.stats["retractions"] > 0
    for i, p in enumerate(ps):
        assert out[f"r{i}"] == expected_output(p, 25)


def test_seeded_sampling_survives_retraction() -> None:
    ps = prompts(6, seed=5, lo=10, hi=20)
    sp = {"temperature": 1.0, "seed": 7}
    big = run_all(make(), [gen_req(f"r{i}", p, 20, **sp) for i, p in enumerate(ps)])
    small_s = make(num_pages=50, chunked_prefill_size=64)
    small = run_all(small_s, [gen_req(f"r{i}", p, 20, **sp) for i, p in enumerate(ps)])
    assert small_s.stats["retractions"] > 0
    assert small == big


def test_max_running_requests_is_respected() -> None:
    s = make(max_running_requests=3)
    run_all(s, [gen_req(f"r{i}", p, 4) for i, p in enumerate(prompts(10))])
    assert s.runner.max_batch <= 3


def test_abort_frees_kv_at_once() -> None:
    s = make()
    s.add_request(gen_req("a", list(range(1, 20)), 50))
    s.add_request(gen_req("b", list(range(1, 5)), 50))
    s.step()
    s.step()
    assert s.in_use_pages() > 0
    outs = s.abort_request("a") + s.abort_request("b")
    assert {o.finish_reason.type for o in outs} == {"abort"}
    assert not s.has_work() and s.in_use_pages() == 0
    s.check_integrity()


def test_eos_min_tokens_stop_ids_and_stop_strings() -> None:
    s = make()
    p = [3, 4, 5]
    exp = expected_output(p, 10)
    # A stop token id: generation ends at its first occurrence.
    stop_tok = exp[4]
    out = run_all(s, [GenerateReq("a", p, {"max_new_tokens": 10, "temperature": 0, "stop_token_ids": [stop_tok]})])
    assert out["a"] == exp[: exp.index(stop_tok) + 1]
    # A stop string made of the text of tokens 2..3 is trimmed from the text.
    text = FakeTokenizer().decode(exp)
    s.add_request(GenerateReq("b", p, {"max_new_tokens": 10, "temperature": 0, "stop": [text[2:4]]}))
    outs = []
    while s.has_work():
        outs += s.step()
    assert outs[-1].finish_reason == FinishReason.stop(text[2:4])
    assert "".join(o.text for o in outs) == text[: text.index(text[2:4])]


def test_too_long_and_bad_requests_are_rejected() -> None:
    s = make(num_pages=100)
    with pytest.raises(ValueError, match="maximum context length"):
        s.add_request(gen_req("a", [1] * 90, 20))
    with pytest.raises(ValueError, match="out of range"):
        s.add_request(gen_req("b", [VOCAB + 5], 2))
    with pytest.raises(ValueError, match="empty"):
        s.add_request(gen_req("c", [], 2))
    assert not s.has_work()


def test_flush_cache() -> None:
    s = make()
    run_all(s, [gen_req("a", list(range(1, 30)), 3)])
    assert s.cache.cached_pages > 0
    assert s.flush_cache()
    assert s.cache.cached_pages == 0 and s.allocator.num_free_pages == s.allocator.num_pages


@pytest.mark.parametrize("chunk", [3, 512])
def test_max_new_tokens_zero_only_scores_the_prompt(chunk: int) -> None:
    """max_new_tokens 0 (completions echo scoring): the prompt is prefilled (in chunks) and scored, nothing
    is sampled, the request ends with "length" and its KV goes to the cache."""
    s = make(chunked_prefill_size=chunk)
    prompt = prompts(1, seed=3, lo=10, hi=10)[0]
    s.add_request(gen_req("z", prompt, 0, prompt_logprobs=True))
    s.add_request(gen_req("g", prompt, 2))
    outs = {}
    while s.has_work():
        for o in s.step():
            outs[o.rid] = o
        s.check_integrity()
    z = outs["z"]
    assert z.token_ids == [] and z.completion_tokens == 0 and z.finish_reason == FinishReason.length()
    assert len(z.prompt_logprobs) == len(prompt) and z.prompt_logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in z.prompt_logprobs[1:])
    assert len(outs["g"].token_ids) == 2 and s.in_use_pages() == 0


def test_the_scheduler_loads_no_torch() -> None:
    """The scheduler, its KV bookkeeping and its step messages are plain Python (unit-testable, importable
    without a model): importing them loads neither torch nor transformers."""
    import subprocess
    import sys

    code = ("import sys\nimport servelm.managers.scheduler, servelm.managers.schedule_batch, "
            "servelm.mem_cache.allocator, servelm.mem_cache.radix_cache\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_request_as_long_as_the_whole_pool_runs(page_size: int) -> None:
    """The context limit is the pool itself (a request alone may fill it: its last token needs no KV slot),
    not a page less: --context-length 1000 --max-total-tokens 1000 serves 1000 tokens."""
    s = make(num_pages=32 // page_size, page_size=page_size)
    assert s.max_context_len == 32
    prompt = prompts(1, seed=3, lo=24, hi=24)[0]
    assert run_all(s, [gen_req("whole", prompt, 8)])["whole"] == expected_output(prompt, 8)
    with pytest.raises(ValueError, match="maximum context length of 32 tokens"):
        s.add_request(gen_req("over", prompt, 9))
