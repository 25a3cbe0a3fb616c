"""Speculative decoding (servelm.speculative) in the scheduler, with no model.

The fake model reads every token back from the KV slots it is given (as tests/managers/test_scheduler.py's),
so a verify row that saw a wrong slot, a rejected draft token left in the KV count, or a page freed too early
changes the output. Its next token depends on the last two tokens read back and, every seventh position, on
the position alone: it copies, so n-gram drafts are often right, and departs, so some are rejected.
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from collections import Counter

import pytest
import torch

from servelm.config import ConfigError, ServerArgs
from servelm.layers.sampler import sample
from servelm.managers.io_struct import GenerateReq
from servelm.managers.schedule_batch import SampleOutput, StepInput
from servelm.managers.scheduler import Scheduler, SchedulerConfig
from servelm.model_executor.forward_batch import ForwardBatch
from servelm.speculative import RateGuard, SpecConfig, SpecState, SuffixStore, lookup, parse_vllm_config

VOCAB = 64
EOS = 0


def copying_next(seen: list[int]) -> int:
    if len(seen) % 7 == 0:
        return 1 + len(seen) * 13 % 17
    return 1 + zlib.crc32(bytes(t % 256 for t in seen[-2:])) % 12


class FakeTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids if not (skip_special_tokens and t == EOS))


class FakeRunner:
    """Greedy: a one-hot row per token from `copying_next`; `soft`: the same fixed distribution on every row."""

    def __init__(self, num_slots: int, soft: list[float] | None = None) -> None:
        self.slot_token = [-1] * num_slots
        self.soft = soft
        self.rows_per_step: list[int] = []

    def execute(self, step: StepInput) -> SampleOutput | None:
        fb = ForwardBatch.from_step(step, torch.device("cpu"))
        for slot, tok in zip(fb.out_cache_loc.tolist(), fb.input_ids.tolist()):
            self.slot_token[slot] = tok
        self.rows_per_step.append(len(step.input_ids))
        rows = []
        for n, kv in zip(fb.extend_lens, fb.kv_indices):
            seen = [self.slot_token[s] for s in kv.tolist()]
            rows += [copying_next(seen[: len(seen) - n + j + 1]) for j in range(n)]
        if self.soft is not None:
            logits = torch.full((len(rows), VOCAB), float("-inf"))
            logits[:, 1: 1 + len(self.soft)] = torch.tensor(self.soft).log()
        else:
            logits = torch.full((len(rows), VOCAB), -10.0)
            logits[torch.arange(len(rows)), torch.tensor(rows)] = 10.0
        logits = logits[fb.logits_indices]
        return sample(logits, step.sample_rows) if step.sample_rows else None


def make(spec: SpecConfig | None, num_pages: int = 2000, page_size: int = 1, soft: list[float] | None = None,
         **kw) -> Scheduler:
    if spec is not None:  # no rate guard: what it decides depends on this machine's step times
        spec = dataclasses.replace(spec, guard=False)
    cfg = SchedulerConfig(num_pages=num_pages, page_size=page_size, max_context_len=10_000, speculative=spec, **kw)
    return Scheduler(FakeRunner(num_pages * page_size, soft), FakeTokenizer(), cfg, [EOS], VOCAB)


def run_all(s: Scheduler, reqs: list[GenerateReq], abort_every: int = 0) -> dict[str, list[int]]:
    for r in reqs:
        s.add_request(r)
    out: dict[str, list[int]] = {r.rid: [] for r in reqs}
    steps = 0
    while s.has_work():
        for o in s.step():
            out[o.rid] += o.token_ids
        s.check_integrity()
        steps += 1
        if abort_every and steps % abort_every == 0 and s.running:
            for o in s.abort_request(s.running[-1].rid):
                out[o.rid] += o.token_ids
    return out


def _requests(n: int, seed: int, max_new: int = 60, **params) -> list[GenerateReq]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 40))]
        reqs.append(GenerateReq(f"r{i}", prompt, {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True,
                                                    **params}))
    return reqs


@pytest.mark.parametrize("algorithm", ["ngram", "suffix"])
@pytest.mark.parametrize(("page_size", "chunk", "pages"), [(1, 512, 2000), (4, 64, 2000), (2, 512, 60)])
def test_output_unchanged_and_drafts_accepted(algorithm: str, page_size: int, chunk: int, pages: int) -> None:
    """Same tokens with and without speculation: paged or not, chunked prefill, a pool so small that
    requests are retracted; the KV accounting holds after every step."""
    reqs = _requests(12, seed=page_size)
    base = run_all(make(None, pages, page_size, chunked_prefill_size=chunk), reqs)
    spec = make(SpecConfig(algorithm, max_batch=64), pages, page_size, chunked_prefill_size=chunk)
    assert run_all(spec, reqs) == base
    info = spec.server_info()
    assert info["spec_decode_num_drafts"] > 20
    assert 0 < info["spec_decode_num_accepted_tokens"] < info["spec_decode_num_draft_tokens"]
    assert info["spec_decode_mean_acceptance_length"] > 1.5
    per_pos = info["spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_pos) == info["spec_decode_num_accepted_tokens"] and per_pos == sorted(per_pos, reverse=True)
    assert spec.allocator.num_free_pages + spec.cache.cached_pages == pages


def test_fewer_steps_and_stop_conditions_see_only_accepted_tokens() -> None:
    reqs = _requests(3, seed=5, max_new=80)
    for p, extra in zip(reqs, [{"stop_token_ids": [7]}, {"stop": ["cd"]}, {"min_new_tokens": 40}]):
        p.sampling_params.update(extra, ignore_eos=False)
    base_s = make(None)
    base = run_all(base_s, reqs)
    spec_s = make(SpecConfig("ngram"))
    assert run_all(spec_s, reqs) == base
    assert len(spec_s.runner.rows_per_step) < len(base_s.runner.rows_per_step)  # type: ignore[attr-defined]
    assert spec_s.stats["generation_tokens"] == base_s.stats["generation_tokens"]


def test_iteration_tokens_count_every_accepted_token() -> None:
    """vLLM's iteration_tokens_total: a verify step counts the tokens it generated, not one a request."""
    s = make(SpecConfig("ngram"))
    reqs = _requests(2, seed=3, max_new=60)
    for r in reqs:
        s.add_request(r)
    counted, most, before = 0, 0, 0
    while s.has_work():
        s.step()
        counted += s.last_step_tokens
        most = max(most, s.stats["generation_tokens"] - before)
        before = s.stats["generation_tokens"]
    # Every prompt once (in the step that ends it) and every generated token once.
    assert counted == sum(len(r.input_ids) for r in reqs) + s.stats["generation_tokens"]
    assert most > 2  # some step accepted drafts


def test_aborts_leave_no_page_behind() -> None:
    """300 mixed requests, some hung up while they speculate: every page ends free or in the cache."""
    reqs = _requests(300, seed=9, max_new=30)
    s = make(SpecConfig("suffix", max_batch=64), num_pages=600, page_size=2, chunked_prefill_size=128)
    run_all(s, reqs, abort_every=5)
    assert s.stats["aborted"] > 20 and s.stats["finished"] + s.stats["aborted"] == 300
    assert not s.running and s.in_use_pages() == 0
    s.check_integrity()
    assert s.allocator.num_free_pages + s.cache.cached_pages == 600


def test_no_speculation_while_more_than_max_batch_decode() -> None:
    reqs = _requests(6, seed=3)
    for i, r in enumerate(reqs):
        r.sampling_params["max_new_tokens"] = 10 + 20 * i
    s = make(SpecConfig("ngram", max_batch=4))
    run_all(s, reqs)
    assert s.spec is not None and s.spec.num_drafts > 0  # once fewer than 5 were left decoding
    rows = s.runner.rows_per_step  # type: ignore[attr-defined]
    assert rows[1:10] == [6] * 9  # 6 decoding: one row each until the first ends


def test_seeded_sampling_keeps_the_target_distribution() -> None:
    """Temperature 1 over a fixed distribution, with a draft proposed at every step: the tokens drawn at the
    verified positions follow the model's probabilities (chi-square), and equal the draws without speculation."""
    probs = [0.45, 0.25, 0.15, 0.1, 0.05]
    reqs = [GenerateReq(f"s{i}", [1, 2, 1, 2, 1, 2, 1], {"max_new_tokens": 5, "temperature": 1.0, "seed": i,
                                                         "ignore_eos": True}) for i in range(1500)]
    base = run_all(make(None, soft=probs, max_running_requests=64), reqs)
    spec_s = make(SpecConfig("ngram", max_batch=64), soft=probs, max_running_requests=64)
    out = run_all(spec_s, reqs)
    assert out == base
    assert spec_s.spec is not None and spec_s.spec.num_drafts > 1000
    counts = Counter(t for toks in out.values() for t in toks[1:])  # [0] was drawn at prefill, not verified
    observed = [counts[t] for t in range(1, 6)]
    n = sum(observed)
    chi2 = sum((o - p * n) ** 2 / (p * n) for o, p in zip(observed, probs))
    assert chi2 < 18.47  # the 0.001 critical value at 4 degrees of freedom


def test_lookup_and_suffix_store() -> None:
    assert lookup([1, 2, 3, 4, 5, 1, 2, 3], 3, 2, 8) == (3, [4, 5, 1])
    assert lookup([1, 2, 3, 4, 5, 1, 2, 3], 9, 4, 8) == (0, [])  # no run of 4 repeats
    assert lookup([1, 2, 3, 4, 5, 6], 3, 1, 8) == (0, [])
    # a hit that straddles token boundaries in the byte search is not a match
    assert lookup([0x0100, 0x0302, 9, 0x0201, 0x0403], 2, 1, 1) == (0, [])
    store = SuffixStore(20, 2, 8)
    store.add([10, 11, 12, 13, 14])
    store.add([20, 21, 22, 23])
    assert store.lookup([5, 11, 12], 4) == (2, [13, 14])  # stops at its sequence's end
    assert store.lookup([13, 14], 3) == (0, [])  # nothing follows it in its own sequence
    assert store.lookup([20, 21, 22], 1) == (3, [23])
    for i in range(10):
        store.add(list(range(100 + i * 5, 105 + i * 5)))
    assert len(store) <= 20 and store.lookup([11, 12], 2) == (0, [])  # the oldest were dropped
    assert store.lookup([140, 141], 3) == (2, [142, 143, 144])


def test_adaptive_draft_length_backs_off_and_recovers() -> None:
    st = SpecState(k=4)
    st.after_verify(4, 4, 6)
    assert st.k == 6
    st.after_verify(6, 2, 6)
    assert st.k == 3
    for _ in range(3):
        st.after_verify(3, 0, 6)
    assert st.k == 1 and st.pause == 8 and st.pause_len == 16
    st.pause = 0
    for _ in range(3):
        st.after_verify(1, 0, 6)
    assert st.pause == 16


def test_flags_and_vllm_config() -> None:
    args = ServerArgs(speculative_config='{"method": "suffix", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    cfg = args.spec_config()
    assert (cfg.algorithm, cfg.num_draft_tokens, cfg.max_match, cfg.min_match) == ("suffix", 3, 5, 2)
    assert args.replace(port=1).spec_config() == cfg
    assert ServerArgs(speculative_algorithm="NGRAM").spec_config().algorithm == "ngram"
    assert ServerArgs().spec_config() is None
    # k by default: 8 drafts from the context where the weights take the 16-row kernel, else (and for a draft
    # model, whose every proposal costs a step of it) 4; a given k stays
    ngram = ServerArgs(speculative_algorithm="ngram")
    assert (ngram.spec_config().num_draft_tokens, ngram.spec_config(rows16=True).num_draft_tokens) == (4, 8)
    assert ServerArgs(speculative_algorithm="suffix").spec_config(rows16=True).num_draft_tokens == 8
    assert args.spec_config(rows16=True).num_draft_tokens == 3
    draft = ServerArgs(speculative_algorithm="draft", speculative_draft_model_path="x")
    assert draft.spec_config(rows16=True).num_draft_tokens == 4
    with pytest.raises(ConfigError, match="not supported; choose one of: ngram, suffix, draft"):
        ServerArgs(speculative_algorithm="eagle")
    with pytest.raises(ConfigError, match="num-draft-tokens must be in"):
        ServerArgs(speculative_algorithm="ngram", speculative_num_draft_tokens=0)
    with pytest.raises(ConfigError, match="unsupported keys draft_model"):
        parse_vllm_config('{"method": "ngram", "draft_model": "x"}')
    with pytest.raises(ConfigError, match="method 'eagle' is not supported"):
        ServerArgs(speculative_config='{"method": "eagle"}')
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_vllm_config("{method: ngram}")


def test_retraction_while_speculating_keeps_outputs() -> None:
    """A pool of 80 slots for 12 requests: requests with a draft are retracted and come back as prefills."""
    reqs = _requests(12, seed=2, max_new=30)
    spec = make(SpecConfig("ngram", max_batch=64), num_pages=40, page_size=2)
    assert run_all(spec, reqs) == run_all(make(None, num_pages=40, page_size=2), reqs)
    assert spec.stats["retractions"] > 5 and spec.spec is not None and spec.spec.num_drafts > 5


def test_rate_guard_switches_speculation_off_where_it_loses_and_retries() -> None:
    g = RateGuard(min_samples=10, window=8, margin=0.9, cooldown=50)
    for _ in range(30):  # batch 1: drafting gives 150 tok/s against 100
        g.observe(1, True, 3, 0.02)
        g.observe(1, False, 1, 0.01)
    assert g.allows(1) and g.switched_off == 0
    for _ in range(10):  # batch 2: drafting gives 150 tok/s against 200 -> off there only
        g.observe(2, False, 2, 0.01)
    for _ in range(7):
        g.observe(2, True, 3, 0.02)
    assert g.allows(2)  # the window is not complete yet
    g.observe(2, True, 3, 0.02)
    assert not g.allows(2) and g.allows(1) and g.switched_off == 1
    for _ in range(49):
        g.observe(2, False, 2, 0.01)
    assert not g.allows(2)
    g.observe(2, False, 2, 0.01)
    assert g.allows(2)  # after the cooldown it is tried again
    # a window with one slow step among fast ones is not a loss
    for i in range(8):
        g.observe(2, True, 5, 0.05 if i == 3 else 0.02)
    assert g.allows(2) and g.switched_off == 1


def test_scheduler_reports_the_guard() -> None:
    s = Scheduler(FakeRunner(4000), FakeTokenizer(), SchedulerConfig(num_pages=4000, max_context_len=10_000,
                                                                      speculative=SpecConfig("ngram")), [EOS], VOCAB)
    run_all(s, _requests(2, seed=4))
    assert s.spec is not None and s.spec.guard is not None and s.spec.guard._steps > 0
    assert s.server_info()["spec_decode_times_switched_off"] >= 0
