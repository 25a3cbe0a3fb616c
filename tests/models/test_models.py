"""Model code vs transformers, logit-close, on tiny random models of each architecture."""

from __future__ import annotations

import pytest
import torch

from servelm.config import ServerArgs
from servelm.model_executor.forward_batch import ForwardBatch
from servelm.model_executor.model_runner import ModelRunner
from tests.conftest import build_tiny_model


def _run(runner: ModelRunner, ids: list[int], start: int, end: int, slot_base: int) -> torch.Tensor:
    """Compute positions [start, end) of one sequence whose KV lives at slot_base + position."""
    fb = ForwardBatch.build(ids[start:end], list(range(start, end)), [slot_base + p for p in range(start, end)],
                            [end - start], [[slot_base + p for p in range(end)]], list(range(end - start)),
                            runner.device)
    return runner.forward(fb)


@pytest.mark.parametrize("fast", [False, True], ids=["eager", "onednn"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_logits_match_transformers(arch: str, fast: bool, tmp_path, default_tokenizer_dir) -> None:
    extra = {"attention_bias": True} if arch == "qwen3" else {}
    folder, ref = build_tiny_model(tmp_path / arch, default_tokenizer_dir, arch, std=0.1, **extra)
    runner = ModelRunner(ServerArgs(model_path=str(folder), max_total_tokens=256, disable_fast_path=not fast))
    assert runner.fast_path == fast
    ids = torch.randint(0, runner.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    # Prefill in one go.
    full = _run(runner, ids, 0, 40, slot_base=0)
    assert (full - expected).abs().max().item() < 1e-4
    # Chunked prefill (13 + 17 tokens) then decode with a cached prefix, one token at a time.
    parts = [_run(runner, ids, 0, 13, 100), _run(runner, ids, 13, 30, 100)]
    parts += [_run(runner, ids, p, p + 1, 100) for p in range(30, 40)]
    stepped = torch.cat(parts)
    assert (stepped - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize(("arch", "rope"), [
    ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}),
    ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
               "rope_theta": 1000000.0}),  # Qwen2.5's long-context setting; its attention factor scales cos/sin
], ids=["llama3", "yarn"])
def test_rope_scaling_matches_transformers(arch: str, rope: dict, tmp_path, default_tokenizer_dir) -> None:
    folder, ref = build_tiny_model(tmp_path / "m", default_tokenizer_dir, arch, std=0.1, rope_parameters=rope)
    runner = ModelRunner(ServerArgs(model_path=str(folder), max_total_tokens=512))
    assert runner.config.rope_parameters["rope_type"] == rope["rope_type"]
    ids = torch.randint(0, runner.vocab_size, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert (_run(runner, ids, 0, 200, 0) - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("original", [8192, 64], ids=["llama-3.2", "unnamed"])
def test_llama3_rope_freqs_of_a_gguf_match_transformers(original: int, tmp_path, default_tokenizer_dir) -> None:
    """A Llama 3.1+ GGUF keeps its llama3 scaling as the rope_freqs tensor (llama.cpp's converter): servelm
    names the scaling when it is a known one (Llama 3.2's), else applies the divisors as llama.cpp does; both
    give transformers' llama3 logits."""
    from tests.models.gguf_files import write_gguf

    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": original, "rope_theta": 500000.0}
    folder, ref = build_tiny_model(tmp_path / "m", default_tokenizer_dir, "llama", std=0.1, rope_parameters=rope,
                                   head_dim=64, max_position_embeddings=1024)
    write_gguf(tmp_path / "m.gguf", "llama", ref)
    runner = ModelRunner(ServerArgs(model_path=str(tmp_path / "m.gguf"), tokenizer_path=str(folder),
                                    max_total_tokens=512))
    params = runner.config.rope_parameters
    if original == 8192:
        assert {k: params[k] for k in rope} == rope
    else:
        assert params["rope_type"] == "default" and len(params["freq_factors"]) == 32
    ids = torch.randint(0, runner.vocab_size, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert (_run(runner, ids, 0, 300, 0) - expected).abs().max().item() < 1e-4


def test_bfloat16_runs_close_to_float32(tmp_path, default_tokenizer_dir) -> None:
    folder, ref = build_tiny_model(tmp_path / "m", default_tokenizer_dir, "qwen3", std=0.1)
    runner = ModelRunner(ServerArgs(model_path=str(folder), max_total_tokens=256, dtype="bfloat16",
                                    kv_cache_dtype="auto"))  # auto: the model's bf16
    assert runner.dtype == torch.bfloat16 and runner.kv_cache.k.dtype == torch.bfloat16
    ids = torch.randint(0, runner.vocab_size, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    got = _run(runner, ids, 0, 30, 0)
    assert got.dtype == torch.float32
    # bf16 keeps ~3 significant digits: compare relative to the logits' scale.
    assert (got - expected).abs().max().item() < 0.05 * expected.abs().max().item()
    # Decode steps on a bf16 KV cache too.
    stepped = torch.cat([_run(runner, ids, 0, 25, 100)] + [_run(runner, ids, p, p + 1, 100) for p in range(25, 30)])
    assert (stepped - expected).abs().max().item() < 0.05 * expected.abs().max().item()


def test_batched_decode_matches_single(tmp_path, default_tokenizer_dir) -> None:
    """A decode batch of sequences with different lengths equals each sequence alone."""
    folder, ref = build_tiny_model(tmp_path / "m", default_tokenizer_dir, "qwen2", std=0.1)
    runner = ModelRunner(ServerArgs(model_path=str(folder), max_total_tokens=512, disable_fast_path=False))
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 9)]
    bases = [0, 100, 200]
    for ids, base in zip(seqs, bases):
        _run(runner, ids, 0, len(ids) - 1, base)
    fb = ForwardBatch.build([s[-1] for s in seqs], [len(s) - 1 for s in seqs],
                            [b + len(s) - 1 for s, b in zip(seqs, bases)], [1, 1, 1],
                            [[b + p for p in range(len(s))] for s, b in zip(seqs, bases)], [0, 1, 2], runner.device)
    assert fb.is_decode
    batched = runner.forward(fb)
    with torch.no_grad():
        for i, ids in enumerate(seqs):
            expected = ref(torch.tensor([ids])).logits[0, -1]
            assert (batched[i] - expected).abs().max().item() < 1e-4


def test_mixed_prefill_and_decode_step_matches_transformers(tmp_path, default_tokenizer_dir) -> None:
    """One forward holding decodes (batched attention) between a fresh prefill and an extend on a prefix."""
    folder, ref = build_tiny_model(tmp_path / "m", default_tokenizer_dir, "llama", std=0.1)
    runner = ModelRunner(ServerArgs(model_path=str(folder), max_total_tokens=512))
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist() for n in (6, 11, 14, 3, 20)]
    bases = [0, 100, 200, 300, 400]
    cached = [5, 0, 10, 2, 8]  # tokens already in the cache: decodes (n - 1), a fresh prefill, extends
    for ids, base, c in zip(seqs, bases, cached):
        if c:
            _run(runner, ids, 0, c, base)
    input_ids, positions, out_loc, lens, kv, logits_rows = [], [], [], [], [], []
    for ids, base, c in zip(seqs, bases, cached):
        input_ids += ids[c:]
        positions += list(range(c, len(ids)))
        out_loc += [base + p for p in range(c, len(ids))]
        lens.append(len(ids) - c)
        kv.append([base + p for p in range(len(ids))])
        logits_rows += list(range(len(logits_rows), len(logits_rows) + len(ids) - c))
    fb = ForwardBatch.build(input_ids, positions, out_loc, lens, kv, logits_rows, runner.device)
    assert fb.decode_reqs == [0, 3] and not fb.is_decode
    got = runner.forward(fb)
    row = 0
    with torch.no_grad():
        for ids, c in zip(seqs, cached):
            expected = ref(torch.tensor([ids])).logits[0, c:]
            assert (got[row:row + len(ids) - c] - expected).abs().max().item() < 1e-4
            row += len(ids) - c


def test_unsupported_architecture_is_named(tmp_path, default_tokenizer_dir) -> None:
    folder, _ = build_tiny_model(tmp_path / "m", default_tokenizer_dir, "llama")
    cfg = (folder / "config.json").read_text().replace("LlamaForCausalLM", "GPTNeoXForCausalLM")
    (folder / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM"):
        ModelRunner(ServerArgs(model_path=str(folder), max_total_tokens=64))
