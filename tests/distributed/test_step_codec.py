"""Rank 0 sends the other TP ranks only what changed in each step: the followers rebuild every StepInput
exactly (slot lists that grow, shrink after rejected drafts, or start over), without a model."""

from __future__ import annotations

import pickle
import random

import pytest

from servelm.distributed.step_codec import FULL_STEPS_ENV, CompactStep, StepDecoder, StepEncoder
from servelm.managers.schedule_batch import StepInput
from servelm.sampling_params import SamplingParams, SamplingRow


def _step(reqs: dict[int, list[int]], keys: list[object], prompt: list[int]) -> StepInput:
    kv = [reqs[k] if isinstance(k, int) else reqs[k[0]][: len(reqs[k[0]]) - 2 + k[1]]  # type: ignore[index]
          for k in keys]
    rows = [SamplingRow(SamplingParams(), 0, 0, len(s), prompt, list(range(len(s)))) for s in kv]
    return StepInput(list(range(len(kv))), [len(s) - 1 for s in kv], [s[-1] for s in kv], [1] * len(kv), kv,
                     list(range(len(kv))), rows, [], keys)


@pytest.mark.parametrize("rows_needed", [False, True])
def test_followers_rebuild_every_step_exactly(rows_needed: bool) -> None:
    rng = random.Random(0)
    enc, dec = StepEncoder(rows_needed), StepDecoder()
    reqs: dict[int, list[int]] = {}
    next_slot, next_key = 0, 0
    full_bytes = compact_bytes = 0
    prompt = list(range(500))
    for _ in range(300):
        action = rng.random()
        if action < 0.1 or not reqs:  # admit a request with a long prompt
            reqs[next_key] = list(range(next_slot, next_slot + rng.randrange(50, 400)))
            next_slot += 400
            next_key += 1
        elif action < 0.15:  # one finishes (its key is reused later, as id() would be)
            del reqs[rng.choice(list(reqs))]
            if rng.random() < 0.5:
                next_key = min(reqs, default=0)
                reqs.pop(next_key, None)
        elif action < 0.2:  # rejected draft slots give their KV back, then new ones follow
            k = rng.choice(list(reqs))
            reqs[k] = reqs[k][: max(1, len(reqs[k]) - 3)] + [next_slot]
            next_slot += 1
        if not reqs:
            continue
        for k in reqs:  # every running request decodes one token
            reqs[k].append(next_slot)
            next_slot += 1
        keys: list[object] = list(reqs)
        if rng.random() < 0.2:  # a verify step: one request's k + 1 rows, each with its own key
            k = rng.choice(list(reqs))
            keys = [key for key in keys if key != k] + [(k, j) for j in range(3)]
        step = _step(reqs, keys, prompt)
        msg = enc.encode(step)
        assert isinstance(msg, CompactStep)
        wire = pickle.loads(pickle.dumps(msg))
        got = dec.decode(wire)
        assert got.kv_indices == step.kv_indices
        assert (got.input_ids, got.positions, got.out_cache_loc, got.extend_lens, got.logits_indices) == (
            step.input_ids, step.positions, step.out_cache_loc, step.extend_lens, step.logits_indices)
        assert len(got.sample_rows) == len(step.sample_rows)
        if rows_needed:
            assert [r.output_ids for r in got.sample_rows] == [r.output_ids for r in step.sample_rows]
        else:
            assert got.sample_rows == [None] * len(step.sample_rows)
        full_bytes += len(pickle.dumps(step))
        compact_bytes += len(pickle.dumps(msg))
    if not rows_needed:
        assert compact_bytes * 10 < full_bytes, (compact_bytes, full_bytes)


def test_full_steps_switch_and_steps_without_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    step = _step({1: [1, 2, 3]}, [1], [1])
    no_keys = StepInput(step.input_ids, step.positions, step.out_cache_loc, step.extend_lens, step.kv_indices,
                        step.logits_indices, step.sample_rows)
    assert StepEncoder(False).encode(no_keys) is no_keys  # sent whole, and passed through by the decoder
    assert StepDecoder().decode(no_keys) is no_keys
    monkeypatch.setenv(FULL_STEPS_ENV, "1")
    assert StepEncoder(False).encode(step) is step


def test_the_scheduler_s_in_place_growth_is_not_mistaken_for_no_change() -> None:
    enc, dec = StepEncoder(False), StepDecoder()
    slots = [0, 1, 2]
    step = _step({7: slots}, [7], [1])
    assert dec.decode(enc.encode(step)).kv_indices == [[0, 1, 2]]
    slots.append(3)  # the scheduler extends req.slots, the same list object
    step = _step({7: slots}, [7], [1])
    msg = enc.encode(step)
    assert msg.kv == [(7, 3, [3])]
    assert dec.decode(msg).kv_indices == [[0, 1, 2, 3]]
