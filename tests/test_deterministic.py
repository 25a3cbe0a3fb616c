"""`enable_deterministic_inference`: the offline Engine gives bit-identical tokens and logprobs for a request
whatever shares its batches, however its prefill is chunked, and whether its prefix came from the cache."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from servelm.entrypoints.engine import Engine
from servelm.layers import batch_invariant

pytestmark = pytest.mark.slow  # starts servers, spawns ranks or loads the default model


@pytest.fixture(autouse=True)
def _switch_off_afterwards() -> Iterator[None]:
    # The switch is process-wide: never leave it on for the test modules that run after this one.
    yield
    batch_invariant.set_batch_invariant(False)


def _gen(engine: Engine, prompts: list[list[int]], params: dict) -> list[dict[str, Any]]:
    # NOTE: the switch is process-wide and set by whichever Engine was built last; these tests build
    # several, so each call re-asserts its own engine's setting.
    batch_invariant.set_batch_invariant(engine.server_args.enable_deterministic_inference)
    out = engine.generate(input_ids=prompts, sampling_params=params)
    engine.scheduler.check_integrity()
    return out  # type: ignore[return-value]


def _prompts(n: int, seed: int, lo: int = 2, hi: int = 150) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


TARGET = _prompts(1, seed=123, lo=90, hi=90)[0]
OTHERS = _prompts(15, seed=7)
PARAMS = [
    {"max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True, "logprobs": True},
    {"max_new_tokens": 20, "temperature": 0.7, "seed": 11, "ignore_eos": True, "logprobs": True},
]


def _key(out: dict[str, Any]) -> tuple:
    # Tokens and logprobs, the floats compared with == (bitwise up to the sign of zero).
    return tuple(out["output_ids"]), tuple(out["logprobs"])


def _variants(engine: Engine, params: dict, seed: int = 0) -> dict[str, tuple]:
    """The target request's output in each setting the guarantee covers."""
    rng = random.Random(seed)
    engine.flush_cache()
    res = {"alone, uncached": _key(_gen(engine, [TARGET], params)[0])}
    res["alone, cached"] = _key(_gen(engine, [TARGET], params)[0])
    for trial in range(2):
        engine.flush_cache()
        others = rng.sample(OTHERS, 15)
        k = rng.randrange(16)
        outs = _gen(engine, others[:k] + [TARGET] + others[k:], params)
        res[f"inside 15 others #{trial}, uncached"] = _key(outs[k])
    # Others first so the target joins running decodes (mixed prefill + decode steps), with its prefix cached.
    engine.flush_cache()
    _gen(engine, [TARGET[:50]], {**params, "max_new_tokens": 1})
    outs = _gen(engine, OTHERS[:6] + [TARGET] + OTHERS[6:], params)
    res["inside 15 others, prefix cached"] = _key(outs[6])
    return res


@pytest.fixture(scope="module")
def engines(tiny_llama) -> dict[str, Engine]:
    folder, _ = tiny_llama
    common = {"model_path": str(folder), "max_total_tokens": 8192}
    return {
        "det": Engine(**common, enable_deterministic_inference=True),
        "det chunk 7": Engine(**common, enable_deterministic_inference=True, chunked_prefill_size=7),
        "det chunk 16": Engine(**common, enable_deterministic_inference=True, chunked_prefill_size=16),
        "plain": Engine(**common),
    }


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "t0.7-seed"])
def test_outputs_are_bitwise_identical_across_batches_cache_and_chunking(engines, params) -> None:
    results: dict[str, tuple] = {}
    for name in ("det", "det chunk 7", "det chunk 16"):
        results.update({f"{name}: {k}": v for k, v in _variants(engines[name], params).items()})
    reference = results["det: alone, uncached"]
    assert len(reference[0]) == 20 and all(lp is not None for lp in reference[1])
    mismatched = [k for k, v in results.items() if v != reference]
    assert not mismatched, f"differs from the request alone: {mismatched}"


def test_without_the_flag_the_same_checks_see_differences(engines) -> None:
    """The checks above have teeth: the plain engine's logprobs move with the batch on this CPU."""
    results = _variants(engines["plain"], PARAMS[1])
    assert len(set(results.values())) > 1


def test_deterministic_mode_still_matches_transformers(engines, tiny_llama) -> None:
    _, ref = tiny_llama
    out = _gen(engines["det"], [TARGET[:40]], {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})[0]
    with torch.no_grad():
        hf = ref.generate(torch.tensor([TARGET[:40]]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                          pad_token_id=0)
    assert out["output_ids"] == hf[0, 40:].tolist()


def test_n2_gives_two_reproducible_samples(engines) -> None:
    params = {"max_new_tokens": 12, "temperature": 1.0, "seed": 5, "n": 2, "logprobs": True}
    engine = engines["det"]
    batch_invariant.set_batch_invariant(True)
    first = [_key(o) for o in engine.generate(input_ids=TARGET, sampling_params=params)]
    second = [_key(o) for o in _gen(engine, OTHERS[:3] + [TARGET], params)[6:8]]
    assert first == second and first[0] != first[1]


def test_eager_linears_are_made_invariant_too(tiny_llama) -> None:
    """Without oneDNN, MKL's F.linear differs below 12 rows: the probe's padding must cover it."""
    folder, _ = tiny_llama
    engine = Engine(model_path=str(folder), max_total_tokens=8192, enable_deterministic_inference=True,
                    disable_fast_path=True, chunked_prefill_size=16)
    params = PARAMS[1]
    engine.flush_cache()
    alone = _key(_gen(engine, [TARGET], params)[0])
    engine.flush_cache()
    assert _key(_gen(engine, OTHERS[:4] + [TARGET], params)[4]) == alone


def test_default_model_alone_vs_inside_others() -> None:
    """The embedded SmolLM2 (GGUF): alone and uncached vs cached, chunked and among 15 other requests."""
    engine = Engine(enable_deterministic_inference=True, max_total_tokens=4096, chunked_prefill_size=48)
    tok = engine.tokenizer
    target = tok.encode("The three most important ideas in thermodynamics are", add_special_tokens=False)
    others = [tok.encode(f"Question {i}: what is {i} times {i + 3}? Answer:" + " and" * (i * 5),
                         add_special_tokens=False) for i in range(15)]
    params = {"max_new_tokens": 8, "temperature": 0.7, "seed": 3, "ignore_eos": True, "logprobs": True}
    alone = _key(_gen(engine, [target], params)[0])
    together = _gen(engine, others[:9] + [target] + others[9:], params)
    assert together[9]["usage"]["cached_tokens"] > 0
    assert _key(together[9]) == alone
