"""A decoder served as an embedding model (Qwen3-Embedding style: the last token's final hidden state,
normalised): a tiny random Qwen3 saved as a sentence-transformers folder is detected from its modules.json and
served by the KV-paged scheduler, prompts chunked and prefixes cached as usual; its /v1/embeddings equal
sentence-transformers' `encode` on the same folder."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import build_tiny_model
from tests.server_fixtures import ServerProcess, start_server

st = pytest.importorskip("sentence_transformers")

pytestmark = pytest.mark.slow  # starts a server

TEXTS = ["Hello world", "a", "The quick brown fox jumps over the lazy dog. " * 4, "naïve café 🙂",
         "Hello world, and more"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, default_tokenizer_dir: Path) -> Path:
    out, _ = build_tiny_model(tmp_path_factory.mktemp("qwen3_embedding"), default_tokenizer_dir, "qwen3")
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                               "pooling_mode_lasttoken": True}))
    return out


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("decoder_embedding") / "server.log"
    srv = start_server(["--model-path", str(folder), "--disable-torch-compile", "--max-total-tokens", "2048",
                        "--chunked-prefill-size", "16", "--served-model-name", "qwen3-emb"], log)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def test_last_token_embeddings_equal_sentence_transformers(server: ServerProcess, folder: Path) -> None:
    ref = st.SentenceTransformer(str(folder), device="cpu").encode(TEXTS)
    for _ in range(2):  # the second time with the prompts' prefixes in the cache
        r = httpx.post(f"{server.base_url}/v1/embeddings", json={"input": TEXTS, "encoding_format": "float"},
                       timeout=60)
        assert r.status_code == 200, r.text
        got = np.array([d["embedding"] for d in r.json()["data"]])
        assert got.shape == (len(TEXTS), 64)
        cos = (got * ref).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1)
        assert cos.min() >= 0.99999, cos
        np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)
    info = httpx.get(f"{server.base_url}/server_info", timeout=30).json()
    assert info["num_running"] == 0 and info["num_waiting"] == 0 and info["kv_in_use_tokens"] == 0
    models = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"]
    assert models[0]["task"] == "embed"


def test_a_decoder_embedder_refuses_generation(server: ServerProcess) -> None:
    r = httpx.post(f"{server.base_url}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout=30)
    assert r.status_code == 400 and "is an embedding model" in r.json()["error"]["message"]
    assert httpx.post(f"{server.base_url}/v1/embeddings", json={"input": "still here"}, timeout=30).status_code == 200
