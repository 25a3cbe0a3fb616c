"""Quantised weights in the layers and the loader: each TP rank's shard of a `QuantWeight` holds exactly the
blocks of its fp32 shard, one copy of each weight is kept, and `--quantization` picks what is quantised."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from servelm.config import ConfigError, ServerArgs
from servelm.kernels import quant
from servelm.layers import batch_invariant, embedding, linear
from servelm.layers.embedding import VocabParallelEmbedding
from servelm.layers.kernel_choice import freeze_kernels
from servelm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear, quant_linear
from servelm.model_executor.forward_batch import ForwardBatch
from servelm.model_executor.model_runner import ModelRunner, _quant_weights
from servelm.model_loader import load_model_source
from servelm.model_loader.quantization import resolve_quantization
from tests.conftest import build_tiny_model
from tests.models.gguf_files import random_k_quant as _random_k
from tests.models.gguf_files import write_gguf

pytestmark = pytest.mark.slow  # starts servers, spawns ranks or loads the default model


@pytest.fixture
def fake_tp(monkeypatch: pytest.MonkeyPatch):
    """Build layers as TP rank `rank` of `size` (no process group: only the loaders run)."""
    def set_rank(rank: int, size: int) -> None:
        for mod in (linear, embedding):
            monkeypatch.setattr(mod, "get_tp_rank", lambda: rank)
            monkeypatch.setattr(mod, "get_tp_size", lambda: size)
    return set_rank


def _load(layer, tensors: list[torch.Tensor], fmt: str | None, ref: str = "q4_1") -> None:
    for shard_id, t in enumerate(tensors):
        loaded = quant.quantize(t, fmt) if fmt else quant.dequantize(quant.quantize(t, ref))
        layer.weight_loader(layer.weight, loaded, shard_id if len(tensors) > 1 else None)
    if hasattr(layer, "finish_loading"):
        layer.finish_loading()


def _weight(layer) -> torch.Tensor:
    return quant.dequantize(layer.qweight) if layer.qweight is not None else layer.weight.data


LAYERS = {
    "qkv": (lambda: QKVParallelLinear(64, 32, num_heads=4, num_kv_heads=2), [(128, 64), (64, 64), (64, 64)]),
    "gate_up": (lambda: MergedColumnParallelLinear(64, [128, 128]), [(128, 64), (128, 64)]),
    "row": (lambda: RowParallelLinear(128, 64), [(64, 128)]),
    "embedding": (lambda: VocabParallelEmbedding(10, 64), [(10, 64)]),
}


@pytest.mark.parametrize("fmt", ["q4_1", "q5_0"])  # q5_0: the qh words split with their blocks
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_quantized_shard_equals_fp32_shard(fake_tp, kind: str, tp: int, fmt: str) -> None:
    """Rows (column-parallel, q/k/v with KV heads replicated at tp 4, vocab padded to a multiple of tp) and
    whole blocks of columns (row-parallel): the kept blocks are exactly this rank's fp32 shard."""
    make, shapes = LAYERS[kind]
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=gen) for s in shapes]
    for rank in range(tp):
        fake_tp(rank, tp)
        fp32, kept = make(), make()
        _load(fp32, full, None, ref=fmt)
        _load(kept, full, fmt)
        assert kept.weight is None and kept.qweight.fmt == fmt  # one copy: the blocks
        assert torch.equal(_weight(kept), fp32.weight.data), (kind, rank)


def test_mixed_shard_formats_stay_blocks_and_blocks_with_fp32_fall_back(fake_tp) -> None:
    """q in q4_1 with k and v in q8_0 (a Q4_K_M file's Q4_K q/k and Q6_K v): one weight per run of a format,
    outputs concatenated, bias split along; blocks mixed with an fp32 shard are dequantised to fp32."""
    fake_tp(0, 1)
    parts = [torch.randn(128, 64), torch.randn(64, 64), torch.randn(64, 64)]
    fmts = ["q4_1", "q8_0", "q8_0"]
    layer = QKVParallelLinear(64, 32, num_heads=4, num_kv_heads=2, bias=True)
    for shard_id, (t, fmt) in enumerate(zip(parts, fmts, strict=True)):
        layer.weight_loader(layer.weight, quant.quantize(t, fmt), shard_id)
    layer.bias.data.copy_(torch.randn(256))
    layer.finish_loading()
    assert layer.qweight is None and layer.weight is None
    assert [(p.fmt, p.shape) for p in layer.qweight_parts] == [("q4_1", (128, 64)), ("q8_0", (128, 64))]
    x = torch.randn(3, 64)
    # each part as the kernel computes it alone (on its activation scheme: int8 codes of x on AVX-512 VNNI)
    y = torch.cat([quant.linear(x, quant.quantize(t, f)) for t, f in zip(parts, fmts, strict=True)], dim=-1)
    torch.testing.assert_close(layer(x), y + layer.bias, rtol=1e-5, atol=1e-5)

    mixed = QKVParallelLinear(64, 32, num_heads=4, num_kv_heads=2)
    mixed.weight_loader(mixed.weight, quant.quantize(parts[0], "q4_1"), 0)
    mixed.weight_loader(mixed.weight, parts[1], 1)
    mixed.weight_loader(mixed.weight, quant.quantize(parts[2], "q8_0"), 2)
    mixed.finish_loading()
    assert mixed.qweight is None and mixed.qweight_parts is None
    expected = torch.cat([quant.dequantize(quant.quantize(parts[0], "q4_1")), parts[1],
                          quant.dequantize(quant.quantize(parts[2], "q8_0"))])
    assert torch.equal(mixed.weight.data, expected)


def test_row_parallel_split_inside_a_block_is_a_clear_error(fake_tp) -> None:
    fake_tp(1, 2)
    layer = RowParallelLinear(96, 64)  # 48 inputs per rank: a 32-weight block cut in half
    with pytest.raises(ConfigError, match="--tp-size 2 splits the 96 inputs of a row-parallel linear .* shards of "
                                          "48, not a multiple of the 32-weight q4_0 block"):
        layer.weight_loader(layer.weight, quant.quantize(torch.randn(64, 96), "q4_0"))
    for fmt in ("q3_k", "q4_k", "q6_k"):  # k-quants split on whole 256-weight super-blocks only
        layer = RowParallelLinear(256, 64)
        with pytest.raises(ConfigError, match=f"shards of 128, not a multiple of the 256-weight {fmt} block"):
            layer.weight_loader(layer.weight, _random_k(fmt, 64, 256, seed=1)[1])
        layer = RowParallelLinear(512, 64)
        _, qw = _random_k(fmt, 64, 512, seed=2)
        layer.weight_loader(layer.weight, qw)
        layer.finish_loading()
        assert torch.equal(quant.dequantize(layer.qweight), quant.dequantize(qw)[:, 256:])  # rank 1's half


def test_quantised_weight_of_the_wrong_shape_is_refused_at_load(fake_tp) -> None:
    fake_tp(0, 1)
    layer = RowParallelLinear(64, 32)
    layer.weight_loader(layer.weight, quant.quantize(torch.randn(32, 96), "q8_0"))  # K 96, the model says 64
    with pytest.raises(ValueError, match=r"quantised weight is \[32, 96\], the model expects \[32, 64\]"):
        layer.finish_loading()
    emb = VocabParallelEmbedding(100, 64)
    with pytest.raises(ValueError, match="has 96 columns, the model's hidden size is 64"):
        emb.weight_loader(emb.weight, quant.quantize(torch.randn(100, 96), "q8_0"))


def test_prepack_frees_the_plain_weight() -> None:
    layer = RowParallelLinear(64, 32)
    layer.weight.data.normal_()
    x = torch.randn(3, 64)
    expected = torch.nn.functional.linear(x, layer.weight.data)
    assert layer.prepack()
    assert layer.weight is None and dict(layer.named_parameters()) == {}
    torch.testing.assert_close(layer(x), expected)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1", "Q5_0", "Q5_1"])
def test_gguf_blocks_kept_equal_the_dequantised_weights(tmp_path: Path, fmt: str, tiny_llama) -> None:
    """Raw blocks straight from the file (q/k rows un-permuted) hold exactly the dequantised fp32 weights."""
    _, model = tiny_llama
    write_gguf(tmp_path / "m.gguf", "llama", model, quantize=fmt)
    source = load_model_source(str(tmp_path / "m.gguf"))
    fp32 = dict(source.iter_weights(torch.float32))
    kept = dict(source.iter_weights(torch.float32, keep_formats=frozenset({fmt.lower()})))
    assert fp32.keys() == kept.keys()
    for name, value in kept.items():
        if fp32[name].dim() == 2:
            assert isinstance(value, quant.QuantWeight) and value.fmt == fmt.lower(), name
            assert torch.equal(quant.dequantize(value), fp32[name]), name
        else:
            assert torch.equal(value, fp32[name]), name


def test_quantization_policy() -> None:
    cpu, f32 = torch.device("cpu"), torch.float32
    assert resolve_quantization("auto", "gguf", f32, cpu).keep_formats == frozenset(quant.FORMATS)
    assert {"q4_k", "q5_k", "q6_k", "q5_0"} <= set(quant.FORMATS)
    assert not resolve_quantization("auto", "hf", f32, cpu).quantized
    assert not resolve_quantization("auto", "gguf", torch.bfloat16, cpu).quantized
    assert not resolve_quantization("none", "gguf", f32, cpu).quantized
    assert resolve_quantization("none", "gguf", f32, cpu).lookup_formats == frozenset(quant.FORMATS)
    assert not resolve_quantization("none", "hf", f32, cpu).lookup_formats
    assert not resolve_quantization("none", "gguf", torch.bfloat16, cpu).lookup_formats  # the blocks give fp32
    assert resolve_quantization("int8", "hf", f32, cpu).target == "q8_0"
    with pytest.raises(ConfigError, match="--quantization q4_0 needs float32 compute on the CPU"):
        resolve_quantization("q4_0", "hf", torch.bfloat16, cpu)


def _logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    return runner.forward(ForwardBatch.build(ids, list(range(n)), list(range(n)), [n], [list(range(n))],
                                             list(range(n)), runner.device))


def _logits_int16(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """The same forward on the int16-activation scheme (power-of-two scales, ~2^-15 of a block's largest |x|):
    where the default rounds x to int8 codes (AVX-512 VNNI, ~1/254 of a block's largest), a comparison to fp32
    rounding would measure x's rounding, not the kept blocks' values."""
    frozen = runner.kernels  # the model's kernels are frozen at build: swapped here for one forward
    int16 = {"avx512_vnni_i8": "avx512_vnni", "avx2_i8": "avx2"}.get(frozen.quant, frozen.quant)
    # the 16-row layout is the int8 path's alone: its weights go back to rows for this forward
    interleaved = [qw for m in runner.model.modules() for qw in _quant_weights(m, lookup=False) if qw.rows16]
    saved = [dataclasses.replace(qw) for qw in interleaved]
    for qw in interleaved:
        rows = quant.rows_of(qw)
        for f in quant._FIELDS:
            setattr(qw, f, getattr(rows, f))
        qw.rows16 = False
    runner.model.model.__dict__.pop("_fused_stack_cache", None)  # its C++ stack holds the tensors it was built on
    freeze_kernels(runner.model, dataclasses.replace(frozen, quant=int16))
    try:
        return _logits(runner, ids)
    finally:
        freeze_kernels(runner.model, frozen)
        for qw, old in zip(interleaved, saved, strict=True):
            for f in (*quant._FIELDS, "rows16"):
                setattr(qw, f, getattr(old, f))
        runner.model.model.__dict__.pop("_fused_stack_cache", None)


def _int8_scheme_error(runner: ModelRunner, ids: list[int], ref: torch.Tensor) -> float:
    """Relative norm error of the default forward (int8 activations where the CPU has VNNI) against `ref`."""
    got = _logits(runner, ids)
    return float((got - ref).norm() / ref.norm())


def test_hf_model_quantised_at_load(tmp_path: Path, default_tokenizer_dir: Path) -> None:
    """int8 on a HF folder: every matrix becomes q8_0 blocks (the tied embedding serves the lookup and the LM
    head from one copy), a quarter of the fp32 bytes, and logits close to fp32."""
    folder, _ = build_tiny_model(tmp_path, default_tokenizer_dir, "llama", std=0.1)
    common = {"model_path": str(folder), "max_total_tokens": 64}
    fp32 = ModelRunner(ServerArgs(**common))
    int8 = ModelRunner(ServerArgs(**common, quantization="int8"))
    assert fp32.weight_formats() == {"float32": 9} and int8.weight_formats() == {"q8_0": 9}
    assert int8.model_info()["weight_bytes"] < 0.3 * fp32.model_info()["weight_bytes"]
    ids = [5, 17, 300, 42, 7, 900, 11]
    a, b = _logits(fp32, ids), _logits(int8, ids)
    # Measured 2.5% on this random model (Q8_0 rounds each weight by up to 0.4% of its block's largest).
    assert (a - b).norm() < 0.05 * a.norm()


@pytest.mark.parametrize("backend", [None, "torch"], ids=["kernel", "torch-fallback"])
def test_deterministic_mode_rows_do_not_depend_on_the_batch(backend: str | None) -> None:
    """The C++ kernel is batch-invariant as it is; the torch fallback is padded to probed row counts."""
    gen = torch.Generator().manual_seed(1)
    qw, bias = quant.quantize(torch.randn(96, 64, generator=gen), "q4_1"), torch.randn(96, generator=gen)
    x = torch.randn(40, 64, generator=gen)
    quant.force_backend(backend)
    batch_invariant.set_batch_invariant(True)
    try:
        full = quant_linear(x, qw, bias)
        for m in (1, 2, 3, 11, 17):
            assert torch.equal(quant_linear(x[:m], qw, bias), full[:m]), m
    finally:
        batch_invariant.set_batch_invariant(False)
        quant.force_backend(None)


@pytest.mark.parametrize(("arch", "gguf_arch", "fmt", "extra"), [
    ("LlamaForCausalLM", "llama", "Q4_0", {"tie_word_embeddings": False}),  # untied LM head: its own blocks
    ("Qwen2ForCausalLM", "qwen2", "Q8_0", {"tie_word_embeddings": True}),  # q/k/v bias next to the blocks
    ("Qwen3ForCausalLM", "qwen3", "Q4_1", {"head_dim": 16, "tie_word_embeddings": False}),
    ("Qwen2ForCausalLM", "qwen2", "Q5_0", {"tie_word_embeddings": True}),  # what a small Qwen's Q4_K_M mostly is
    ("LlamaForCausalLM", "llama", "Q5_1", {"tie_word_embeddings": False}),
    ("LlamaForCausalLM", "llama", "IQ4_NL", {"tie_word_embeddings": False}),  # nibbles through a table
])
def test_kept_blocks_compute_the_dequantised_model(tmp_path: Path, tiny_llama, arch: str, gguf_arch: str, fmt: str,
                                                    extra: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks kept from the file hold the very values `none` dequantises: the logits agree to fp32 rounding. The
    AVX-512 VNNI path's 16-row layout computes the row layout's model: the same codes of x, another fp32 order."""
    from tests.models.test_model_loader import _tiny_model

    write_gguf(tmp_path / "m.gguf", gguf_arch, _tiny_model(arch, **extra), quantize=fmt)
    common = {"model_path": str(tmp_path / "m.gguf"), "tokenizer_path": str(tiny_llama[0]), "max_total_tokens": 64}
    fp32 = ModelRunner(ServerArgs(**common, quantization="none"))
    rows16 = ModelRunner(ServerArgs(**common))
    expect_rows16 = quant.rows16_default() and fmt.lower() in quant.ROWS16_FORMATS
    monkeypatch.setenv(quant.ROWS16_ENV, "0")  # the row layout, which every kernel path reads
    kept = ModelRunner(ServerArgs(**common))
    assert set(kept.weight_formats()) == {fmt.lower()} and set(fp32.weight_formats()) == {"float32"}
    ids = [5, 17, 30, 42, 7, 60, 11]
    ref = _logits(fp32, ids)
    torch.testing.assert_close(_logits_int16(kept, ids), ref, rtol=1e-4, atol=1e-4)
    err = _int8_scheme_error(kept, ids, ref)
    print(f"{fmt}: default scheme {quant.activation_scheme(fmt.lower())}, relative error {err:.4f}")
    assert err < 0.05
    assert any(qw.rows16 for m in rows16.model.modules() for qw in _quant_weights(m, lookup=False)) == expect_rows16
    torch.testing.assert_close(_logits(rows16, ids), _logits(kept, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("quantize", "hidden", "formats", "v0"), [
    ("Q4_K_M", 256, {"q4_k": 8, "q6_k": 2}, ["q4_k", "q6_k"]),
    # hidden 96 (not whole super-blocks, as Qwen2.5-0.5B's 896): the fallbacks Q5_0 and Q8_0, Q4_K for ffn_down
    ("Q4_K_M", 96, {"q5_0": 6, "q4_k": 2, "q8_0": 2}, ["q5_0", "q8_0"]),
    ("Q3_K_M", 256, {"q3_k": 6, "q4_k": 4, "q6_k": 1}, ["q3_k", "q4_k"]),
    ("Q2_K", 256, {"q2_k": 6, "q3_k": 4, "q6_k": 1}, ["q2_k", "q3_k"]),
    # the fallbacks IQ4_NL, Q5_0 and Q8_0; ffn_down's 512 stay
    ("Q3_K_M", 96, {"iq4_nl": 6, "q4_k": 2, "q5_0": 2, "q8_0": 1}, ["iq4_nl", "q5_0"]),
    ("IQ4_XS", 256, {"iq4_xs": 9}, None),
    ("IQ4_XS", 96, {"iq4_nl": 7, "iq4_xs": 2}, None),  # rows of 96: the IQ4_NL fallback; ffn_down's 512 stay
])
def test_k_quant_gguf_is_served_from_blocks(tmp_path: Path, default_tokenizer_dir: Path, quantize: str,
                                            hidden: int, formats: dict, v0: list | None) -> None:
    """A Q4_K_M-style file (Q4_K matrices, Q6_K tied embedding and layer 0's v, and llama-quantize's fallbacks
    for rows that are not whole super-blocks), a Q3_K_M-style one (Q3_K, Q4_K v and down, Q6_K embedding), a
    Q2_K-style one (Q2_K, Q3_K v and down, Q6_K embedding), or
    an IQ4_XS one (IQ4_NL fallbacks): `auto` keeps every tensor
    at its own bits (layer 0's qkv holds one weight per run of a format), in at most 1.05x the file's bytes,
    and computes what `none` computes from gguf's own dequantisation of the same file, to fp32 rounding."""
    folder, model = build_tiny_model(tmp_path / "hf", default_tokenizer_dir, "llama", std=0.1, hidden_size=hidden,
                                     intermediate_size=512, head_dim=32 if hidden == 96 else 64)
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", model, quantize=quantize)
    common = {"model_path": str(path), "tokenizer_path": str(folder), "max_total_tokens": 64}
    fp32 = ModelRunner(ServerArgs(**common, quantization="none"))
    kept = ModelRunner(ServerArgs(**common))
    assert kept.weight_formats() == formats and fp32.weight_formats() == {"float32": 9}
    if v0 is not None:
        assert [p.fmt for p in kept.model.model.layers[0].self_attn.qkv_proj.qweight_parts] == v0
    from gguf import GGUFReader

    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
    assert kept.model_info()["weight_bytes"] <= 1.05 * file_bytes
    ids = [5, 17, 300, 42, 7, 900, 11]
    a, b = _logits(fp32, ids), _logits_int16(kept, ids)
    err = _int8_scheme_error(kept, ids, a)
    print(f"{formats}: default scheme relative error {err:.4f}")
    assert err < 0.05
    # The same weights; only x's int16 rounding (~2^-15 of each block's largest |x|) and fp32 sums differ
    # (measured 1.5-2.9e-4 of the norm; 2.0% when Q6_K was requantised to Q8_0, O(1) for a nibble out of place).
    assert (a - b).norm() < 1e-3 * a.norm(), float((a - b).norm() / a.norm())
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def _no_lookup_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--quantization none` as before issue 13's lookup blocks: every weight dequantised to fp32."""
    from servelm.model_executor import model_runner
    from servelm.model_loader import quantization

    monkeypatch.setattr(model_runner, "resolve_quantization", lambda *args: quantization.NONE)


def _hidden(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """The final hidden states of a one-request prefill (what the LM head reads)."""
    n = len(ids)
    fb = ForwardBatch.build(ids, list(range(n)), list(range(n)), [n], [list(range(n))], list(range(n)), runner.device)
    fb.kv_cache = runner.kv_cache
    with torch.inference_mode():
        return runner.model.model(fb)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1"])
def test_none_tied_embedding_lookup_reads_the_blocks(tmp_path: Path, tiny_llama, monkeypatch: pytest.MonkeyPatch,
                                                      fmt: str) -> None:
    """`none` on a GGUF whose tied embedding is in a kernel format: the lookup reads the file's blocks, the LM
    head the packed fp32 matrix (no plain fp32 copy); lookup rows, hidden states and logits are bitwise those of
    the dequantised fp32 weights, and the reported bytes are the blocks plus the packed copy."""
    write_gguf(tmp_path / "m.gguf", "llama", tiny_llama[1], quantize=fmt)
    common = {"model_path": str(tmp_path / "m.gguf"), "tokenizer_path": str(tiny_llama[0]), "max_total_tokens": 64,
              "quantization": "none"}
    blocks = ModelRunner(ServerArgs(**common))
    emb = blocks.model.model.embed_tokens
    assert blocks.model.lm_head is emb and emb.lookup_qweight.fmt == fmt.lower()
    assert emb.qweight is None and emb.weight is None and blocks.model.logits_processor.packed is not None
    assert blocks.weight_formats() == {"float32": 9}  # the embedding computes in fp32

    with monkeypatch.context() as m:
        _no_lookup_blocks(m)
        fp32 = ModelRunner(ServerArgs(**common))  # one plain fp32 copy for the lookup and the LM head
    fp32_emb = fp32.model.model.embed_tokens
    assert fp32_emb.lookup_qweight is None and fp32.model.logits_processor.packed is None
    ids = torch.arange(emb.vocab_size)
    assert torch.equal(emb(ids), fp32_emb(ids))  # every row, bitwise
    assert torch.equal(emb(ids), torch.nn.functional.embedding(ids, fp32_emb.weight))
    packed = linear.prepack_weight(fp32_emb.weight.data)
    for prompt in ([5, 17, 300, 42, 7, 900, 11], [3]):
        hidden = _hidden(fp32, prompt)
        assert torch.equal(_hidden(blocks, prompt), hidden)
        assert torch.equal(_logits(blocks, prompt), linear.packed_linear(hidden, packed, None))
    assert blocks.weight_bytes - fp32.weight_bytes == emb.lookup_qweight.nbytes > 0


def test_none_tied_embedding_without_a_packed_head_stays_plain_fp32(tmp_path: Path, tiny_llama) -> None:
    """With --disable-fast-path the LM head reads the plain fp32 weight, which serves the lookup too: no blocks."""
    write_gguf(tmp_path / "m.gguf", "llama", tiny_llama[1], quantize="Q8_0")
    runner = ModelRunner(ServerArgs(model_path=str(tmp_path / "m.gguf"), tokenizer_path=str(tiny_llama[0]),
                                    max_total_tokens=64, quantization="none", disable_fast_path=True))
    emb = runner.model.model.embed_tokens
    assert emb.lookup_qweight is None and emb.qweight is None and emb.weight is not None
    assert runner.model.logits_processor.packed is None


def test_none_untied_gguf_and_hf_folder_keep_no_blocks(tmp_path: Path, tiny_llama, default_tokenizer_dir: Path) -> None:
    from tests.models.test_model_loader import _tiny_model

    write_gguf(tmp_path / "m.gguf", "llama", _tiny_model("LlamaForCausalLM", tie_word_embeddings=False),
               quantize="Q8_0")
    untied = ModelRunner(ServerArgs(model_path=str(tmp_path / "m.gguf"), tokenizer_path=str(tiny_llama[0]),
                                    max_total_tokens=64, quantization="none"))
    assert untied.model.model.embed_tokens.lookup_qweight is None
    assert untied.weight_formats() == {"float32": 10}
    hf = ModelRunner(ServerArgs(model_path=str(tiny_llama[0]), max_total_tokens=64, quantization="none"))
    assert hf.model.model.embed_tokens.lookup_qweight is None


@pytest.mark.parametrize(("gguf_arch", "quantize", "hidden"), [
    ("llama", "Q4_K_M", 256),  # layer 0's qkv in two parts (Q4_K q/k, Q6_K v), a Q6_K tied LM head
    ("llama", "Q3_K_M", 256),  # every layer's qkv in two parts (Q3_K q/k, Q4_K v), Q3_K gate/up, Q4_K down
    ("llama", "IQ4_XS", 256),  # a lookup format (on AVX2: signed table values, vpsignb)
    ("qwen2", "Q5_0", 96),  # q/k/v bias, hidden not whole super-blocks
])
def test_fused_decode_layer_gives_the_layer_ops_bits(tmp_path: Path, default_tokenizer_dir: Path, monkeypatch,
                                                     gguf_arch: str, quantize: str, hidden: int) -> None:
    """A decode step through `fused.decode_stack` (every layer's one C++ call from one loop) and through
    `fused.decode_layer` layer by layer give bitwise the logits of the layer's own ops, for a batch of two
    requests at different lengths."""
    from servelm.layers import fused

    folder, model = build_tiny_model(tmp_path / "hf", default_tokenizer_dir, gguf_arch, std=0.1, hidden_size=hidden,
                                     intermediate_size=512, head_dim=32 if hidden == 96 else 64)
    write_gguf(tmp_path / "m.gguf", gguf_arch, model, quantize=quantize)
    runner = ModelRunner(ServerArgs(model_path=str(tmp_path / "m.gguf"), tokenizer_path=str(folder),
                                    max_total_tokens=64))
    layers = runner.model.model.layers
    if not fused.loaded():
        pytest.skip("no kernel library")
    assert all(layer.fused_decode_args() is not None for layer in layers)
    a, b = [5, 17, 300, 42, 7, 900, 11], [8, 4, 600, 23, 99]
    for ids, start in ((a, 0), (b, 10)):  # the two prompts' KV
        slots = list(range(start, start + len(ids)))
        runner.forward(ForwardBatch.build(ids, list(range(len(ids))), slots, [len(ids)], [slots], [len(ids) - 1],
                                          runner.device))
    step = ForwardBatch.build([33, 44], [7, 5], [7, 15], [1, 1], [list(range(8)), list(range(10, 16))], [0, 1],
                              runner.device)
    stacks, calls = [], []
    real_stack, real_layer = fused.decode_stack, fused.decode_layer
    monkeypatch.setattr(fused, "decode_stack", lambda *args: stacks.append(1) or real_stack(*args))
    monkeypatch.setattr(fused, "decode_layer", lambda *args: calls.append(1) or real_layer(*args))
    stack_logits = runner.forward(step)  # every layer's call from one loop (LlamaModel._fused_stack)
    assert len(stacks) == 1 and not calls
    monkeypatch.setattr(runner.model.model, "_fused_stack", lambda *args: None)
    fused_logits = runner.forward(step)  # the same step again, layer by layer: the same KV slots and values
    assert len(calls) == len(layers) and len(stacks) == 1
    for layer in layers:
        layer._fused_args = (None,)  # the layer's own ops from here on
    own = runner.forward(step)
    assert len(calls) == len(layers)
    assert torch.equal(stack_logits, fused_logits) and torch.equal(fused_logits, own)
