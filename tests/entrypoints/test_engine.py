"""The offline Engine on a tiny random Llama, checked against transformers and against itself."""

from __future__ import annotations

import random

import pytest
import torch

from servelm.entrypoints.engine import Engine


@pytest.fixture(scope="module")
def engine(tiny_llama):
    folder, _ = tiny_llama
    eng = Engine(model_path=str(folder), max_total_tokens=4096)
    yield eng
    eng.scheduler.check_integrity()


@pytest.fixture(autouse=True)
def _integrity(request):
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        eng.scheduler.check_integrity()
        assert eng.scheduler.in_use_pages() == 0 and not eng.scheduler.has_work()


def _prompts(n: int, seed: int = 0, vocab: int = 1000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 60))] for _ in range(n)]


def _hf_greedy(ref, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                           pad_token_id=0)
    return out[0, len(ids):].tolist()


GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def test_greedy_matches_transformers(engine, tiny_llama) -> None:
    _, ref = tiny_llama
    for ids in _prompts(3, seed=1):
        out = engine.generate(input_ids=ids, sampling_params=GREEDY)
        assert out["output_ids"] == _hf_greedy(ref, ids, 12)
        assert out["usage"]["completion_tokens"] == 12 and out["finish_reason"]["type"] == "length"


def test_batch_of_16_equals_one_at_a_time(engine) -> None:
    ps = _prompts(16, seed=2)
    engine.flush_cache()
    alone = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in ps]
    engine.flush_cache()
    batched = [o["output_ids"] for o in engine.generate(input_ids=ps, sampling_params=GREEDY)]
    assert batched == alone


def test_radix_hit_equals_miss(engine) -> None:
    base = _prompts(1, seed=3)[0] + _prompts(1, seed=4)[0]
    engine.flush_cache()
    miss = engine.generate(input_ids=base, sampling_params=GREEDY)
    hit = engine.generate(input_ids=base, sampling_params=GREEDY)
    assert miss["usage"]["cached_tokens"] == 0 and hit["usage"]["cached_tokens"] == len(base) - 1
    assert hit["output_ids"] == miss["output_ids"]
    longer = engine.generate(input_ids=base + [5, 6, 7], sampling_params=GREEDY)
    assert longer["usage"]["cached_tokens"] >= len(base)


def test_chunked_prefill_equals_unchunked(tiny_llama) -> None:
    folder, ref = tiny_llama
    eng = Engine(model_path=str(folder), max_total_tokens=2048, chunked_prefill_size=7, page_size=4,
                 disable_radix_cache=True)
    ps = _prompts(4, seed=5)
    outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
    for p, o in zip(ps, outs):
        assert o["output_ids"] == _hf_greedy(ref, p, 12)
    eng.scheduler.check_integrity()


def test_eviction_and_retraction_under_tiny_pool(tiny_llama) -> None:
    folder, ref = tiny_llama
    eng = Engine(model_path=str(folder), max_total_tokens=160)
    ps = _prompts(6, seed=6)
    ps = [p[:30] for p in ps]
    outs = eng.generate(input_ids=ps, sampling_params={**GREEDY, "max_new_tokens": 20})
    for p, o in zip(ps, outs):
        assert o["output_ids"] == _hf_greedy(ref, p, 20)
    assert eng.scheduler.stats["retractions"] > 0
    eng.scheduler.check_integrity()
    assert eng.scheduler.in_use_pages() == 0


def test_seeded_sampling_reproducible_and_n_differs(engine) -> None:
    sp = {"max_new_tokens": 16, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 42, "ignore_eos": True}
    ids = _prompts(1, seed=7)[0]
    a = engine.generate(input_ids=ids, sampling_params=sp)
    b = engine.generate(input_ids=ids, sampling_params=sp)
    assert a["output_ids"] == b["output_ids"]
    # Inside a batch of others the seeded draw is unchanged.
    mixed = engine.generate(input_ids=[_prompts(1, seed=8)[0], ids], sampling_params=sp)
    assert mixed[1]["output_ids"] == a["output_ids"]
    two = engine.generate(input_ids=ids, sampling_params={**sp, "n": 2})
    assert len(two) == 2 and two[0]["output_ids"] != two[1]["output_ids"]
    assert two == engine.generate(input_ids=ids, sampling_params={**sp, "n": 2})
    other_seed = engine.generate(input_ids=ids, sampling_params={**sp, "seed": 43})
    assert other_seed["output_ids"] != a["output_ids"]


def test_logprobs_match_transformers(engine, tiny_llama) -> None:
    _, ref = tiny_llama
    ids = _prompts(1, seed=9)[0]
    out = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 4, "logprobs": True,
                                                          "top_logprobs": 3})
    seq = ids + out["output_ids"]
    with torch.no_grad():
        logits = ref(torch.tensor([seq])).logits[0].log_softmax(-1)
    for k, tok in enumerate(out["output_ids"]):
        row = logits[len(ids) - 1 + k]
        assert abs(out["logprobs"][k] - row[tok].item()) < 1e-4
        top = out["top_logprobs"][k]
        assert [t for t, _ in top] == row.topk(3).indices.tolist()
        assert top[0][0] == tok


@pytest.mark.parametrize("chunk", [512, 7])
def test_prompt_logprobs_match_transformers(tiny_llama, chunk: int) -> None:
    """Every prompt token after the first is scored, also across prefill chunks, on a cached prefix (which
    has no logits: it is recomputed) and with a penalty (prompt scores are raw)."""
    folder, ref = tiny_llama
    eng = Engine(model_path=str(folder), max_total_tokens=2048, chunked_prefill_size=chunk, page_size=4)
    ps = _prompts(3, seed=11)
    sp = {**GREEDY, "max_new_tokens": 3, "prompt_logprobs": True, "top_logprobs": 2, "repetition_penalty": 1.3}
    eng.generate(input_ids=ps[0], sampling_params=GREEDY)  # ps[0] now sits in the prefix cache
    outs = eng.generate(input_ids=ps + [ps[0][:1]], sampling_params=sp)
    for ids, out in zip(ps, outs):
        with torch.no_grad():
            ref_lp = ref(torch.tensor([ids])).logits[0].log_softmax(-1)
        lps, tops = out["prompt_logprobs"], out["prompt_top_logprobs"]
        assert len(lps) == len(tops) == len(ids) and lps[0] is None and tops[0] is None
        for p in range(1, len(ids)):
            assert abs(lps[p] - ref_lp[p - 1, ids[p]].item()) < 1e-4
            assert [t for t, _ in tops[p]] == ref_lp[p - 1].topk(2).indices.tolist()
        assert "logprobs" not in out  # not asked for the completion
    assert outs[-1]["prompt_logprobs"] == [None]  # a one-token prompt has nothing to score
    # The sampled tokens do not change when the prompt is scored.
    assert [o["output_ids"] for o in outs] == [
        o["output_ids"] for o in eng.generate(input_ids=ps + [ps[0][:1]], sampling_params={
            **sp, "prompt_logprobs": False})]
    eng.scheduler.check_integrity()
    assert eng.scheduler.in_use_pages() == 0


def test_constrained_decoding_survives_retraction(tiny_llama) -> None:
    """json_schema and regex outputs stay valid when requests are retracted and recomputed; a constrained
    greedy request equals the unconstrained one whenever the model's own choice is allowed."""
    import json
    import re

    folder, _ = tiny_llama
    eng = Engine(model_path=str(folder), max_total_tokens=160)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "tag": {"enum": ["a", "bb", "ccc"]}},
              "required": ["n", "tag"], "additionalProperties": False}
    ps = [p[:30] for p in _prompts(6, seed=12)]
    sp = {"max_new_tokens": 40, "temperature": 0.8, "seed": 1, "ignore_eos": True}
    outs = eng.generate(input_ids=ps, sampling_params=[{**sp, "json_schema": json.dumps(schema)}] * 3
                        + [{**sp, "regex": "[a-c]{3}-[0-9]{1,5}"}] * 3)
    assert eng.scheduler.stats["retractions"] > 0
    for o in outs[:3]:
        obj = json.loads(o["text"])
        assert set(obj) == {"n", "tag"} and 0 <= obj["n"] <= 999 and obj["tag"] in ("a", "bb", "ccc")
        assert o["finish_reason"] == {"type": "stop", "matched": None}
    for o in outs[3:]:
        assert re.fullmatch("[a-c]{3}-[0-9]{1,5}", o["text"]), o["text"]
    # Alone and unretracted, the seeded draws are the same.
    alone = eng.generate(input_ids=ps[0], sampling_params={**sp, "json_schema": json.dumps(schema)})
    assert alone["output_ids"] == outs[0]["output_ids"]
    with pytest.raises(ValueError, match="regex"):
        eng.generate(input_ids=ps[0], sampling_params={**sp, "regex": "(unclosed"})
    eng.scheduler.check_integrity()
    assert eng.scheduler.in_use_pages() == 0


def test_stop_strings_trimmed_and_min_tokens(engine) -> None:
    ids = _prompts(1, seed=10)[0]
    full = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 10})
    text = full["text"]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), "need a visible stop string"
    out = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 10, "stop": [stop]})
    assert out["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.index(stop)]
    # max_new_tokens bounds, min_new_tokens + stop token id
    first = full["output_ids"][0]
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 5, "temperature": 0,
                                                          "stop_token_ids": [first]})
    assert out["output_ids"] == [first] and out["finish_reason"]["matched"] == first
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 5, "temperature": 0, "min_new_tokens": 3,
                                                          "stop_token_ids": [first]})
    assert len(out["output_ids"]) >= 3 and out["output_ids"][0] != first


def test_streaming_equals_non_streaming(engine) -> None:
    ids = _prompts(1, seed=11)[0]
    whole = engine.generate(input_ids=ids, sampling_params=GREEDY)
    chunks = list(engine.generate(input_ids=ids, sampling_params=GREEDY, stream=True))
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert sum((c["output_ids"] for c in chunks), []) == whole["output_ids"]
    assert chunks[-1]["usage"]["completion_tokens"] == 12


def test_text_prompt_and_bad_params(engine) -> None:
    out = engine.generate("Hello there", {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert len(out["output_ids"]) == 3 and isinstance(out["text"], str)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate("Hello", {"top_p": 0})
    with pytest.raises(ValueError, match="maximum context length"):
        engine.generate(input_ids=[5] * 10, sampling_params={"max_new_tokens": 5000})
