"""Quantised weights under tensor parallelism and in deterministic mode: a tiny Llama written as a Q4_1 GGUF
keeps its blocks on every rank (column shards by rows, row-parallel shards by whole blocks, vocab shards
padded with zero blocks) and TP=2 gives the TP=1 tokens, also through the LM-head all-to-all. The same with
`--quantization none`, where only the tied embedding's lookup reads (vocab-sharded) blocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from servelm.entrypoints.engine import Engine
from servelm.kernels import quant
from tests.conftest import build_tiny_model
from tests.distributed.test_tp import GREEDY, _assert_same, _prompts
from tests.models.gguf_files import write_gguf
from tests.test_deterministic import _switch_off_afterwards, _variants  # noqa: F401 (the fixture is autouse)

pytestmark = pytest.mark.slow  # starts servers, spawns ranks or loads the default model


@pytest.fixture(scope="module")
def q4_1_gguf(tmp_path_factory, default_tokenizer_dir) -> tuple[Path, Path]:
    """(a tiny tied Llama as a Q4_1 GGUF: every matrix, the embedding too; its HF folder, for the tokenizer)."""
    folder, model = build_tiny_model(tmp_path_factory.mktemp("tiny_hf"), default_tokenizer_dir, "llama", std=0.5)
    path = tmp_path_factory.mktemp("tiny_q4_1") / "tiny.Q4_1.gguf"
    write_gguf(path, "llama", model, quantize="Q4_1")
    return path, folder


def _engine(model: tuple[Path, Path], **kw) -> Engine:
    path, tokenizer = model
    return Engine(model_path=str(path), tokenizer_path=str(tokenizer), **{"max_total_tokens": 2048, **kw})


def _run(model: tuple[Path, Path], **kw) -> list[dict]:
    engine = _engine(model, **kw)
    try:
        info = engine.scheduler.model_info()
        if kw.get("quantization") == "none":
            # fp32 compute; the tied embedding's lookup reads this rank's vocab shard of the blocks.
            assert info["weight_formats"] == {"float32": 9}, info
            assert engine.scheduler.runner.model.model.embed_tokens.lookup_qweight.fmt == "q4_1"
        else:
            # Every matrix kept as Q4_1 blocks: 2 layers x (qkv, o, gate_up, down) + the tied embedding.
            assert info["quantization"] == "auto" and info["weight_formats"] == {"q4_1": 9}, info
        return engine.generate(input_ids=_prompts(), sampling_params=GREEDY)
    finally:
        engine.shutdown()


# The kernel rounds each block of 32 activations to integer codes: int16 (a step of 2^-15 of the block's largest
# |x|), or int8 on AVX-512 VNNI (1/127 of it). Where TP's all-reduce adds partial sums in another fp32 order, a
# 1e-7 change of an activation can move a code by one step, which this tiny model's std-0.5 random weights
# amplify to up to 2.6e-3 in the logprobs with int16 codes (measured on the AVX-512 and AVX2 paths; 1e-4 with
# fp32 activations) and 0.058 with int8 ones (AVX-512 VNNI). The tokens must still be the same; a wrong shard
# gives O(1) differences.
QUANT_TP_LOGPROB_TOL = 0.15 if quant.activation_scheme("q4_1") == "int8" else 1e-2


def test_tp2_q4_1_equals_tp1(q4_1_gguf) -> None:
    _assert_same(_run(q4_1_gguf, tp_size=2), _run(q4_1_gguf), QUANT_TP_LOGPROB_TOL)
    # Deterministic mode keeps prefill on the int16 scheme too (the default mode's prefill takes the fp32 tile
    # kernel), so it is compared with a deterministic TP=1 run.
    _assert_same(_run(q4_1_gguf, tp_size=2, enable_tp_lm_head_all_to_all=True, enable_deterministic_inference=True),
                 _run(q4_1_gguf, enable_deterministic_inference=True), QUANT_TP_LOGPROB_TOL)


def test_tp2_none_with_lookup_blocks_equals_tp1(q4_1_gguf) -> None:
    base = _run(q4_1_gguf, quantization="none")
    _assert_same(_run(q4_1_gguf, quantization="none", tp_size=2), base)
    _assert_same(_run(q4_1_gguf, quantization="none", tp_size=2, enable_tp_lm_head_all_to_all=True,
                      enable_deterministic_inference=True), base)


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_deterministic_q4_1_is_batch_invariant(q4_1_gguf, quantization: str) -> None:
    """The target request's tokens and logprobs are bitwise the same alone, cached, and inside batches (`none`:
    the lookup reads the tied embedding's blocks, the LM head the packed fp32 matrix)."""
    engine = _engine(q4_1_gguf, max_total_tokens=8192, enable_deterministic_inference=True, quantization=quantization)
    try:
        res = _variants(engine, {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True, "logprobs": True})
    finally:
        engine.shutdown()
    first = next(iter(res.values()))
    assert all(v == first for v in res.values()), {k: v[0] for k, v in res.items()}
