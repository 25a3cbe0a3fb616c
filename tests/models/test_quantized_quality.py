"""Quality of quantised weights on the default model (SmolLM2-135M-Instruct, a Q4_1 GGUF), relative to the
same model dequantised to fp32 (`--quantization none`), by the two figures every llama.cpp user's numbers are
judged by (issue 20's bar; "the same greedy text as fp32" is not one: a near tie, 0.0028 nats on an AMD EPYC,
flips with any change of rounding):

* perplexity on English prose (tests/data: Pride and Prejudice, chapters 1-2, Jane Austen 1813, public
  domain) within 1% of fp32's;
* teacher-forced top-1 agreement with fp32 (the argmax after each prefix of the same text) of at least 97%.

Both for Q4_1 kept (`auto`; the prompt is scored by a prefill, so many rows: the int8 panel GEMM on AVX-512
VNNI and AVX2, `quant.many_rows_scheme`), Q4_1 kept on the micro-kernel that decode
uses (`auto_int`: deterministic mode keeps every row count on it; int8 activations on AVX-512 VNNI and AVX2,
int16 elsewhere, `quant.activation_scheme`), and int8 (q8_0 blocks quantised at load from the dequantised fp32
weights). Measured on an AMD EPYC (Zen 5, AVX-512 VNNI), 2026-12-02: perplexity +0.15% / -0.09% / -0.26%,
top-1 agreement 97.07% / 97.46% / 97.85% (auto / auto_int / int8); with SERVELM_QUANT_KERNEL=avx2_i8 +0.19% /
-0.16% and 97.07% / 97.26% for auto / auto_int. On a Zen 3 EPYC (AVX2 only, avx2_i8), 2026-12-04, with Q8_0's
prompts on the int16 panel: top-1 agreement 97.85% / 97.07% / 97.85% (int8 x codes on Q8_0 had given int8
95.41%: quant.many_rows_scheme keeps int16 codes for it). On a Zen 4 EPYC (AVX-512 VNNI), 2026-12-04, with Q8_0's
prompts on the AVX-512 int16 panel (K >= 1,024; the fp32 tiles below): +0.15% / -0.09% / -0.26%, 97.07% / 97.46% /
97.85% (int8 x codes on Q8_0 there: int8 96.09%).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from gguf import GGUFReader

from servelm.entrypoints.engine import Engine
from servelm.layers import batch_invariant
from servelm.model_loader import default_model_path

pytestmark = pytest.mark.slow  # starts servers, spawns ranks or loads the default model

TEXT = Path(__file__).parent.parent / "data" / "pride_and_prejudice_ch1-2.txt"
PPL_TOKENS = 1024


def _measure(mode: str, deterministic: bool = False) -> dict:
    engine = Engine(quantization=mode, max_total_tokens=4096, enable_deterministic_inference=deterministic)
    try:
        tok = engine.tokenizer
        ids = tok.encode(TEXT.read_text(encoding="utf-8"), add_special_tokens=False)[:PPL_TOKENS]
        out = engine.generate(input_ids=[ids], sampling_params={"max_new_tokens": 1, "prompt_logprobs": True,
                                                                "prompt_top_logprobs": 1})
        logprobs = out[0]["prompt_logprobs"][1:]
        top1 = [t[0][0] for t in out[0]["prompt_top_logprobs"][1:]]  # argmax after each prefix
        assert len(top1) == len(logprobs) == len(ids) - 1
        result = {"ppl": math.exp(-sum(logprobs) / len(logprobs)), "top1": top1,
                  "info": engine.scheduler.model_info()}
        print(f"quality {mode}{' deterministic' if deterministic else ''}: perplexity {result['ppl']:.4f}")
        return result
    finally:
        engine.shutdown()
        batch_invariant.set_batch_invariant(False)  # process-wide: never left on for later tests


@pytest.fixture(scope="module")
def measured() -> dict[str, dict]:
    # The prompt is scored by a prefill: many rows take the kernel's many-rows path, so "auto" measures that
    # one; deterministic mode keeps every row count on the micro-kernel that decode uses.
    return {"none": _measure("none"), "auto": _measure("auto"), "int8": _measure("int8"),
            "auto_int": _measure("auto", deterministic=True)}


def test_formats_and_resident_bytes(measured) -> None:
    assert measured["none"]["info"]["weight_formats"] == {"float32": 121}
    assert measured["auto"]["info"]["weight_formats"] == {"q4_1": 120, "q8_0": 1}  # the tied embedding: Q8_0
    assert measured["int8"]["info"]["weight_formats"] == {"q8_0": 121}
    # The file's blocks, held once: no more than 1.3x the GGUF file (measured 0.98x).
    assert measured["auto"]["info"]["weight_bytes"] <= 1.3 * os.path.getsize(default_model_path())
    # fp32 held once: the tied embedding's lookup reads the file's Q8_0 blocks, the LM head the packed fp32
    # matrix (measured 1.056x; 1.21x with the plain fp32 copy the lookup read before).
    fp32_bytes = 4 * sum(int(t.n_elements) for t in GGUFReader(default_model_path()).tensors)
    assert measured["none"]["info"]["weight_bytes"] <= 1.1 * fp32_bytes


QUANTISED = ("int8", "auto", "auto_int")


@pytest.mark.parametrize("mode", QUANTISED)
def test_perplexity_within_1_percent_of_fp32(measured, mode: str) -> None:
    fp32, quantised = measured["none"]["ppl"], measured[mode]["ppl"]
    assert 1 < fp32 < 100  # natural English to a language model
    assert abs(quantised / fp32 - 1) <= 0.01, (mode, quantised, fp32)


@pytest.mark.parametrize("mode", QUANTISED)
def test_teacher_forced_top1_agrees_with_fp32(measured, mode: str) -> None:
    want, got = measured["none"]["top1"], measured[mode]["top1"]
    agree = sum(a == b for a, b in zip(got, want, strict=True)) / len(want)
    print(f"quality {mode}: teacher-forced top-1 agreement with fp32 {agree:.4f}")
    assert agree >= 0.97, (mode, agree)
