"""Quality of each KV-cache dtype (`--kv-cache-dtype`) on the default model (SmolLM2-135M-Instruct, its
weights dequantised to fp32: `--quantization none`, so that the figures are the cache's alone; with the Q4_1
blocks kept, the int8 rounding of activations turns any small change into its own +-0.2% of perplexity noise,
as a re-roll of which codes round which way), against the fp32 cache: perplexity over the whole of
tests/data's prose (~2k tokens, Pride and Prejudice ch. 1-2) within 0.1% for bfloat16 / float16 and within 1%
for int8 and fp8_e4m3 (issue 21's bar; fp8_e5m2 misses it, see BOUND), and teacher-forced top-1 agreement
reported beside it. `pytest -s` prints the figures."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from servelm.entrypoints.engine import Engine

pytestmark = pytest.mark.slow  # loads the default model once per dtype

TEXT = Path(__file__).parent.parent / "data" / "pride_and_prejudice_ch1-2.txt"
# fp8_e5m2 misses the 1%: two mantissa bits, and a scale cannot add precision to a float format
# (measured +2.49%, top-1 agreement 89.3%); its bound records that, so a regression still fails.
BOUND = {"bfloat16": 0.001, "float16": 0.001, "int8": 0.01, "fp8_e4m3": 0.01, "fp8_e5m2": 0.03}


def _info(engine: Engine) -> dict:
    info = engine.scheduler.model_info()
    return {"dtype": info["kv_cache_dtype"], "capacity": info["kv_capacity_tokens"]}


def _score(kv: str) -> dict:
    engine = Engine(kv_cache_dtype=kv, max_total_tokens=4096, quantization="none")
    try:
        ids = engine.tokenizer.encode(TEXT.read_text(encoding="utf-8"), add_special_tokens=False)
        out = engine.generate(input_ids=[ids], sampling_params={"max_new_tokens": 1, "prompt_logprobs": True,
                                                                "prompt_top_logprobs": 1})
        logprobs = out[0]["prompt_logprobs"][1:]
        top1 = [t[0][0] for t in out[0]["prompt_top_logprobs"][1:]]
        return {"ppl": math.exp(-sum(logprobs) / len(logprobs)), "top1": top1, "tokens": len(ids), **_info(engine)}
    finally:
        engine.shutdown()


def _resolved(kv: str) -> dict:
    """What `kv` resolves to, without scoring it (the 2k-token prefill is ~9 s a dtype here)."""
    engine = Engine(kv_cache_dtype=kv, max_total_tokens=4096, quantization="none")
    try:
        return _info(engine)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def measured() -> dict[str, dict]:
    return {**{kv: _score(kv) for kv in ("float32", *BOUND)}, "auto": _resolved("auto")}


@pytest.mark.parametrize("kv", list(BOUND))
def test_perplexity_against_fp32_kv(measured, kv: str) -> None:
    ref, got = measured["float32"], measured[kv]
    assert got["dtype"] == kv and ref["tokens"] >= 1900
    change = got["ppl"] / ref["ppl"] - 1
    agree = sum(a == b for a, b in zip(got["top1"], ref["top1"], strict=True)) / len(ref["top1"])
    print(f"kv {kv}: perplexity {got['ppl']:.4f} against fp32 KV {ref['ppl']:.4f} ({change * 100:+.3f}%), "
          f"top-1 agreement {agree * 100:.2f}% over {ref['tokens']} tokens")
    assert abs(change) <= BOUND[kv]


def test_auto_is_a_16_bit_cache_on_an_fp32_model(measured) -> None:
    assert measured["auto"]["dtype"] in ("bfloat16", "float16")
    # the same 4096-token budget: --max-total-tokens is in tokens, whatever the dtype
    assert measured["auto"]["capacity"] == measured["float32"]["capacity"] == 4096
