"""Batched sampling: penalties, greedy, temperature, top-k/top-p/min-p, seeded draws.

Randomness never comes from a global generator: each row draws from a
generator seeded by (request seed, sample index, position), so a request's
tokens do not depend on what else is in the batch or on retraction and
recomputation. The draw is Gumbel-max, so filtering stays a logits mask.
"""

from __future__ import annotations

import torch

from servelm.constrained import allowed_tokens
from servelm.layers import fused
from servelm.sampling_params import SampleOutput, SamplingParams, SamplingRow

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, sample_index: int, position: int) -> int:
    """splitmix64 over the three counters: a well-spread 63-bit seed per draw."""
    x = (seed * 0x9E3779B97F4A7C15 + sample_index * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: penalties (HF/OpenAI semantics), logit_bias, banned ids and the constraint mask of each row."""
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        p = row.params
        if row.target is not None:
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long,
                                device=logits.device)
            if seen.numel():
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        if (p.frequency_penalty or p.presence_penalty) and row.output_ids:
            ids = torch.tensor(row.output_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(ids, minlength=vocab)[:vocab].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        allowed = allowed_tokens(row.allowed, vocab).to(logits.device) if row.allowed is not None else None
        if row.banned_ids:
            banned = torch.tensor(sorted(set(row.banned_ids)), dtype=torch.long, device=logits.device)
            if allowed is None:
                logits[i, banned] = float("-inf")
            elif allowed.sum() > allowed[banned].sum():
                allowed[banned] = False
            # else: the grammar allows only banned tokens (say EOS before min_tokens): the grammar wins.
        if allowed is not None:
            logits[i].masked_fill_(~allowed, float("-inf"))


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row [V], already divided by temperature -> logits with excluded tokens at -inf."""
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (keeps at least one).
        drop_sorted = (probs.cumsum(-1) - probs) >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if p.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def num_top_logprobs(row: SamplingRow) -> int:
    """How many top alternatives a row reports: a scored prompt token its own number (vLLM's prompt_logprobs)."""
    p = row.params
    if row.target is not None and p.prompt_top_logprobs is not None:
        return p.prompt_top_logprobs
    return p.top_logprobs


def gumbel_noise(row: SamplingRow, vocab: int, device: torch.device) -> torch.Tensor:
    """float64 Gumbel noise [vocab] of one draw, from a generator on `device` seeded by the row's counters.
    The same seed gives the same noise on every CPU; a GPU's generator gives other (equally seeded) draws."""
    gen = torch.Generator(device=device).manual_seed(mix_seed(row.seed, row.sample_index, row.position))
    u = torch.rand(vocab, generator=gen, dtype=torch.float64, device=device).clamp_(min=1e-300)
    return -torch.log(-torch.log(u))


@torch.inference_mode()
def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SampleOutput:
    """logits: fp32 [R, V] (raw model output; modified in place)."""
    which = [i for i, r in enumerate(rows) if r.wants_logprob]
    # Only the rows that report logprobs (a scored prompt chunk has one row per token: no second copy).
    raw_logprobs = None
    if which:
        raw_logprobs = torch.log_softmax(logits if len(which) == len(rows) else logits[which], dim=-1)
    apply_penalties(logits, rows)
    tokens: list[int] = []
    greedy = [i for i, r in enumerate(rows) if r.target is None and r.params.is_greedy]
    if greedy:  # every row greedy (a verify step's): no copy of the rows first
        chosen = fused.greedy_argmax(logits if len(greedy) == len(rows) else logits[greedy])
        greedy_tokens = dict(zip(greedy, chosen.tolist()))
    else:
        greedy_tokens = {}
    drawn: dict[int, torch.Tensor] = {}
    for i, row in enumerate(rows):
        if row.target is None and i not in greedy_tokens:
            scaled = filter_logits(logits[i] / row.params.temperature, row.params)
            drawn[i] = torch.argmax(scaled.double() + gumbel_noise(row, scaled.shape[-1], scaled.device))
    # One device-to-host read for every drawn row (on a GPU each read waits for the device).
    drawn_tokens = dict(zip(drawn, torch.stack(list(drawn.values())).tolist())) if drawn else {}
    for i, row in enumerate(rows):
        tokens.append(row.target if row.target is not None else
                      greedy_tokens[i] if i in greedy_tokens else drawn_tokens[i])
    out_lp: list[float | None] = [None] * len(rows)
    out_top: list[list[tuple[int, float]] | None] = [None] * len(rows)
    out_rank: list[int | None] = [None] * len(rows)
    if raw_logprobs is not None:
        rows_at = torch.arange(len(which), device=raw_logprobs.device)
        chosen = torch.tensor([tokens[i] for i in which], dtype=torch.long, device=raw_logprobs.device)
        chosen_lp = raw_logprobs[rows_at, chosen]
        for i, lp in zip(which, chosen_lp.tolist()):
            out_lp[i] = lp
        targets = [j for j, i in enumerate(which) if rows[i].target is not None]
        if targets:  # 1 + how many tokens are more likely than the scored one
            at = torch.tensor(targets, dtype=torch.long, device=raw_logprobs.device)
            above = (raw_logprobs[at] > chosen_lp[at, None]).sum(dim=-1) + 1
            for j, r in zip(targets, above.tolist()):
                out_rank[which[j]] = r
        wanted = [num_top_logprobs(rows[i]) for i in which]
        if max(wanted):
            vals, idx = torch.topk(raw_logprobs, max(wanted), dim=-1)
            for i, n, v, t in zip(which, wanted, vals.tolist(), idx.tolist()):
                if n:
                    out_top[i] = list(zip(t[:n], v[:n]))
    return SampleOutput(tokens, out_lp, out_top, out_rank)
