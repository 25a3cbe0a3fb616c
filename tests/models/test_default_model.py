"""The embedded default model (SmolLM2-135M-Instruct, GGUF): greedy output of the fp32 path equals transformers.

The reference is transformers' LlamaForCausalLM built from the same GGUF tensors (our loader's output; the
loader itself is checked tensor-for-tensor against transformers' own GGUF loading in test_model_loader.py).
Token-exact equality is asked of `--quantization none` only (the weights dequantised to fp32, fp32
arithmetic, as transformers). The default `auto` path keeps the file's Q4_1 blocks and rounds activations per
block, which can flip a near tie (on an AMD EPYC, "List three prime numbers." at token 10: fp32's top two are
0.0028 nats apart); its quality is measured against fp32 in test_quantized_quality.py instead.
"""

from __future__ import annotations

import pytest
import torch

from servelm.bench.common import load_hf_baseline
from servelm.entrypoints.engine import Engine

pytestmark = pytest.mark.slow  # starts servers, spawns ranks or loads the default model

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.fixture(scope="module")
def engine():
    return Engine(max_total_tokens=8192)


@pytest.fixture(scope="module")
def fp32_engine():
    engine = Engine(max_total_tokens=4096, quantization="none")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference():
    return load_hf_baseline(None)


def test_greedy_32_tokens_match_transformers(fp32_engine, reference) -> None:
    engine = fp32_engine
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
               for p in PROMPTS]
    outs = engine.generate(prompts, {"max_new_tokens": 32, "temperature": 0})
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            ref = reference.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                     eos_token_id=engine.scheduler.eos_token_ids, pad_token_id=0)
        assert out["output_ids"] == ref[0, len(ids):].tolist()
        assert out["text"].strip()
    engine.scheduler.check_integrity()


def test_default_model_answers_sensibly(fp32_engine) -> None:
    """The fp32 path. The default path (Q4_1 kept, int8 activations) answers this one "L'Étoile, la Marseillaise,
    la femme au", the same 16 tokens as llama.cpp's llama-completion on the same file (greedy, same template):
    its first token is a 0.1-nat tie that int8 activations flip in both engines (measured 2026-12-02)."""
    tok = fp32_engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], tokenize=False,
                                     add_generation_prompt=True)
    out = fp32_engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0})
    assert "Paris" in out["text"]


def test_default_model_json_object_mode(engine) -> None:
    """response_format json_object's constraint on the real model: a JSON object that says what was asked."""
    import json

    tok = engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Describe the city of Paris as a JSON object "
                                       "with keys name, country and population."}], tokenize=False,
                                     add_generation_prompt=True)
    out = engine.generate(prompt, {"max_new_tokens": 100, "temperature": 0, "json_schema": '{"type": "object"}'})
    assert out["finish_reason"]["type"] == "stop"
    assert json.loads(out["text"])["name"] == "Paris"


def test_servelm_generate_prints_only_the_text(engine) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "servelm", "generate", "--prompt", PROMPTS[0],
                           "--max-new-tokens", "16", "--max-total-tokens", "4096"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    tok = engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], tokenize=False,
                                     add_generation_prompt=True)
    # As the CLI's fresh process does: the whole prompt prefilled (the fp32 tile kernel), not its last token
    # re-run from the prefix cache an earlier test left (the int8 scheme on AVX-512 VNNI, which flips this
    # prompt's first token: "L" and "The" are 0.1 nats apart).
    assert engine.flush_cache()
    expected = engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0})["text"]
    assert proc.stdout == expected + "\n"
    assert "Loaded" in proc.stderr  # logs go to stderr, never stdout
