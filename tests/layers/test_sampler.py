"""Sampler semantics against transformers' logits processors, and seeded-draw properties."""

from __future__ import annotations

import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from servelm.layers.sampler import apply_penalties, filter_logits, sample
from servelm.managers.schedule_batch import SamplingRow
from servelm.sampling_params import SamplingParams


def _row(**kw) -> SamplingRow:
    prompt = kw.pop("prompt", [1, 2])
    output = kw.pop("output", [])
    return SamplingRow(SamplingParams(**kw), seed=1, sample_index=0, position=len(prompt) + len(output),
                       prompt_ids=prompt, output_ids=output)


def test_repetition_penalty_matches_transformers() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    prompt, output = [3, 4, 10], [4, 7]
    expected = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits.clone())
    got = logits.clone()
    apply_penalties(got, [_row(repetition_penalty=1.7, prompt=prompt, output=output)])
    assert torch.allclose(got, expected)


def test_frequency_and_presence_penalties() -> None:
    logits = torch.zeros(1, 10)
    apply_penalties(logits, [_row(frequency_penalty=0.5, presence_penalty=0.25, output=[3, 3, 3, 5])])
    assert logits[0, 3].item() == -(0.5 * 3 + 0.25)
    assert logits[0, 5].item() == -(0.5 + 0.25)
    assert logits[0, 1].item() == 0.0  # prompt tokens are not counted by OpenAI-style penalties


def test_filters_match_transformers_warpers() -> None:
    logits = torch.randn(1, 200, generator=torch.Generator().manual_seed(1)) * 3
    for params, warper in [(SamplingParams(top_k=7), TopKLogitsWarper(7)),
                           (SamplingParams(top_p=0.8), TopPLogitsWarper(0.8)),
                           (SamplingParams(min_p=0.1), MinPLogitsWarper(0.1))]:
        ours = torch.isinf(filter_logits(logits[0].clone(), params))
        theirs = torch.isinf(warper(torch.tensor([[0]]), logits.clone())[0])
        assert torch.equal(ours, theirs), params


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1, 0.0]]))
    counts = torch.zeros(4)
    for pos in range(3000):
        row = SamplingRow(SamplingParams(temperature=1.0), seed=3, sample_index=0, position=pos, prompt_ids=[1],
                          output_ids=[])
        counts[sample(logits.clone(), [row]).token_ids[0]] += 1
    freq = counts / counts.sum()
    assert abs(freq[0] - 0.7) < 0.04 and abs(freq[1] - 0.2) < 0.03 and counts[3] == 0


def test_greedy_banned_ids_and_logprobs() -> None:
    logits = torch.tensor([[5.0, 1.0, 4.0]])
    row = _row(temperature=0, logprobs=True, top_logprobs=2)
    row.banned_ids = [0]
    out = sample(logits.clone(), [row])
    assert out.token_ids == [2]
    # logprobs are of the raw distribution (before bans and penalties)
    assert abs(out.logprobs[0] - torch.log_softmax(logits, -1)[0, 2].item()) < 1e-6
    assert [t for t, _ in out.top_logprobs[0]] == [0, 2]


def test_scoring_rows_report_the_given_token_next_to_sampled_rows() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(4))
    raw = torch.log_softmax(logits, -1)
    score = _row(temperature=0.8, top_logprobs=3, repetition_penalty=2.0, prompt=[5, 6])
    score.target = 6
    plain = _row(temperature=0)  # no logprobs asked
    wide = _row(temperature=0, logprobs=True, top_logprobs=5)
    out = sample(logits.clone(), [score, plain, wide])
    assert out.token_ids == [6, int(logits[1].argmax()), int(logits[2].argmax())]
    # A scoring row is raw (no penalty, no temperature) and has its own number of alternatives.
    assert out.logprobs[0] == raw[0, 6].item() and out.logprobs[1] is None and out.top_logprobs[1] is None
    assert [t for t, _ in out.top_logprobs[0]] == raw[0].topk(3).indices.tolist()
    assert [t for t, _ in out.top_logprobs[2]] == raw[2].topk(5).indices.tolist()
    # the scored token's rank in the whole distribution, in or out of its top 3; none for sampled rows
    assert out.ranks[0] == int((raw[0] > raw[0, 6]).sum()) + 1 and out.ranks[1:] == [None, None]


def test_scored_prompt_tokens_have_their_own_number_of_alternatives() -> None:
    """vLLM's prompt_logprobs=k: a scoring row reports k alternatives whatever top_logprobs says."""
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(5))
    score = _row(temperature=0, top_logprobs=1, prompt_top_logprobs=4, prompt=[5, 6])
    score.target = 6
    zero = _row(temperature=0, top_logprobs=3, prompt_top_logprobs=0, prompt=[5, 6])
    zero.target = 6
    out = sample(logits.clone(), [score, zero])
    assert [t for t, _ in out.top_logprobs[0]] == torch.log_softmax(logits[0], -1).topk(4).indices.tolist()
    assert out.top_logprobs[1] is None and out.logprobs[1] is not None


def test_constraint_mask_limits_the_draw() -> None:
    """Only tokens whose bit is set in the llguidance bitmask can be drawn, greedy or sampled."""
    vocab = 70
    allowed = {3, 40, 65}
    words = [0] * 3
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    mask = torch.tensor(words, dtype=torch.int64).to(torch.int32).numpy().tobytes()
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(5))
    greedy = _row(temperature=0)
    greedy.allowed = mask
    assert sample(logits.clone(), [greedy]).token_ids == [max(allowed, key=lambda t: logits[0, t].item())]
    seen = set()
    for pos in range(200):
        row = SamplingRow(SamplingParams(temperature=5.0), seed=1, sample_index=0, position=pos, prompt_ids=[1],
                          output_ids=[], allowed=mask)
        seen.add(sample(logits.clone(), [row]).token_ids[0])
    assert seen == allowed


def test_bans_never_empty_a_constraint() -> None:
    """min_tokens bans EOS; where the grammar allows only EOS (or nothing else but banned tokens) it wins."""
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(6))
    only_eos = torch.tensor([1 << 2, 0], dtype=torch.int64).to(torch.int32).numpy().tobytes()  # token 2 only
    row = _row(temperature=0)
    row.allowed, row.banned_ids = only_eos, [2, 2]
    assert sample(logits.clone(), [row]).token_ids == [2]
    two = torch.tensor([(1 << 2) | (1 << 7), 0], dtype=torch.int64).to(torch.int32).numpy().tobytes()
    row.allowed = two  # 2 and 7 allowed, 2 banned: 7
    assert sample(logits.clone(), [row]).token_ids == [7]


def test_logit_bias() -> None:
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(8))
    top = int(logits.argmax())
    other = (top + 1) % 30
    up = _row(temperature=0, logit_bias={other: 100})
    down = _row(temperature=0, logit_bias={str(top): -100})  # JSON keys arrive as strings
    out = sample(logits.repeat(2, 1), [up, down])
    assert out.token_ids[0] == other
    assert out.token_ids[1] == int(logits[0].clone().index_fill_(0, torch.tensor([top]), -1e9).argmax())


def test_sampling_params_to_dict_is_asdict_with_its_own_lists() -> None:
    """`to_dict` (copied field by field for speed) gives what `dataclasses.asdict` gives, lists and dicts copied."""
    import dataclasses

    p = SamplingParams(max_new_tokens=7, stop=["a", "b"], stop_token_ids=[3], logit_bias={"5": -1.0},
                       stop_regex="x+", constraint_after=[9], seed=4, json_schema="{}")
    d = p.to_dict()
    assert d == dataclasses.asdict(p) and SamplingParams.from_dict(d) == p
    d["stop"].append("c")
    d["logit_bias"][6] = 1.0
    assert p.stop == ["a", "b"] and p.logit_bias == {5: -1.0}
