"""A tied fp32 embedding is held once: its plain weight serves the lookup and, read in place, the LM head (MKL
up to PLAIN_HEAD_MKL_ROWS sampled rows, oneDNN beyond); an untied head keeps only its oneDNN-packed copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from servelm.config import ServerArgs
from servelm.layers import batch_invariant
from servelm.layers.embedding import VocabParallelEmbedding
from servelm.layers.logits import PLAIN_HEAD_MKL_ROWS, LogitsProcessor, plain_onednn_linear
from servelm.model_executor.forward_batch import ForwardBatch
from servelm.model_executor.model_runner import ModelRunner
from tests.conftest import build_tiny_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN (mkldnn) is not built in")


def _tied_head(vocab: int = 1000, hidden: int = 64) -> tuple[VocabParallelEmbedding, LogitsProcessor]:
    emb = VocabParallelEmbedding(vocab, hidden)
    emb.weight.data.normal_(generator=torch.Generator().manual_seed(0))
    proc = LogitsProcessor(vocab)
    assert proc.prepack(emb)
    return emb, proc


def test_tied_head_reads_the_plain_weight_in_place() -> None:
    emb, proc = _tied_head()
    assert proc.plain_head and proc.packed is None and emb.weight is not None  # one copy, for both
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    for m in (1, 2, 3, 8, 40):
        got = proc(x[:m], emb)
        # MKL at few rows, oneDNN on the plain weight beyond: each bitwise its kernel, and both agree with MKL.
        kernel = F.linear if m <= PLAIN_HEAD_MKL_ROWS else plain_onednn_linear
        assert torch.equal(got, kernel(x[:m], emb.weight)), m
        torch.testing.assert_close(got, F.linear(x[:m], emb.weight), rtol=1e-5, atol=1e-5)


def test_tied_head_rows_are_batch_invariant_in_deterministic_mode() -> None:
    emb, proc = _tied_head()
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
    batch_invariant.set_batch_invariant(True)
    try:
        full = proc(x, emb)
        for m in (1, 2, 3, 5, 17):
            assert torch.equal(proc(x[:m], emb), full[:m]), m
    finally:
        batch_invariant.set_batch_invariant(False)


@pytest.mark.parametrize("tied", [True, False])
def test_hf_fp32_model_holds_each_weight_once(tmp_path: Path, default_tokenizer_dir: Path, tied: bool) -> None:
    """Resident bytes are exactly the fp32 bytes of the checkpoint's parameters (a tied pair counted once), and
    the logits agree with transformers'."""
    folder, ref = build_tiny_model(tmp_path, default_tokenizer_dir, "llama", std=0.1, tie_word_embeddings=tied)
    runner = ModelRunner(ServerArgs(model_path=str(folder), max_total_tokens=64))
    assert runner.fast_path and runner.model.logits_processor.plain_head is tied
    assert runner.weight_bytes == 4 * sum(p.numel() for p in ref.parameters())
    ids = [5, 17, 300, 42, 7, 900, 11]
    n = len(ids)
    logits = runner.forward(ForwardBatch.build(ids, list(range(n)), list(range(n)), [n], [list(range(n))],
                                               list(range(n)), runner.device))
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
