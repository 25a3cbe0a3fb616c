"""POST /v1/rerank over real HTTP on a cross-encoder built in code (a tiny random BertForSequenceClassification):
scores equal to sentence-transformers' CrossEncoder.predict, sorted, top_n, documents as text or objects, the
/rerank and /v2/rerank aliases; bad input is a 400 and the server serves on; an embedding server refuses
rerank, a generative one classify, and a reranker refuses embeddings and chat."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.models.test_bert import cross_encoder_folder
from tests.server_fixtures import ServerProcess, start_server

st = pytest.importorskip("sentence_transformers")

pytestmark = pytest.mark.slow  # starts a server

QUERY = "what do llamas eat?"
DOCS = ["Llamas eat grass and hay.", "The stock market fell today.", "A llama is a camelid from South America.",
        "Bonjour, ça va ?", "word " * 40]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cross_encoder_folder(tmp_path_factory.mktemp("reranker") / "ce")


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("rerank") / "server.log"
    srv = start_server(["--model-path", str(model), "--served-model-name", "reranker"], log)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def _post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def assert_ranked(r: httpx.Response, ref: list[float], tol: float) -> dict:
    """A /v1/rerank response over DOCS: every document once, best first, each score `ref`'s within `tol`, the
    documents echoed. Returns the body."""
    assert r.status_code == 200, r.text
    body = r.json()
    results = body["results"]
    assert sorted(x["index"] for x in results) == list(range(len(DOCS)))
    assert [x["relevance_score"] for x in results] == sorted((x["relevance_score"] for x in results), reverse=True)
    for x in results:
        assert x["relevance_score"] == pytest.approx(float(ref[x["index"]]), abs=tol)
        assert x["document"] == {"text": DOCS[x["index"]]}
    return body


def test_rerank_equals_cross_encoder_predict(server: ServerProcess, model: Path) -> None:
    ref = st.CrossEncoder(str(model), device="cpu").predict([(QUERY, d) for d in DOCS])
    r = _post(server, "/v1/rerank", {"model": "reranker", "query": QUERY, "documents": DOCS})
    body = assert_ranked(r, list(ref), 1e-5)
    assert body["usage"]["total_tokens"] > 0 and body["model"] == "reranker" and body["id"].startswith("rerank-")


def test_top_n_objects_and_aliases(server: ServerProcess) -> None:
    full = _post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS}).json()["results"]
    for path in ("/rerank", "/v2/rerank"):
        top = _post(server, path, {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2,
                                   "return_documents": False}).json()["results"]
        assert [x["index"] for x in top] == [x["index"] for x in full[:2]]
        assert all(x.get("document") is None for x in top)


@pytest.mark.parametrize("body, param", [
    ({"query": QUERY, "documents": []}, "documents"),
    ({"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
    ({"query": QUERY, "documents": ["word " * 200]}, "documents.0"),
    ({"query": QUERY, "documents": DOCS, "truncate_prompt_tokens": 500}, "truncate_prompt_tokens"),
    ({"query": QUERY}, "documents"),
    ({"query": QUERY, "documents": DOCS, "rank_fields": ["x"]}, "rank_fields"),
])
def test_bad_input_is_a_400_and_the_server_serves_on(server: ServerProcess, body: dict, param: str) -> None:
    r = _post(server, "/v1/rerank", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param in (err.get("param") or "") + err["message"], err
    assert _post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS[:1]}).status_code == 200
    assert httpx.get(f"{server.base_url}/server_info", timeout=30).json()["num_waiting"] == 0


def test_long_documents_are_cut_with_truncate_prompt_tokens(server: ServerProcess) -> None:
    r = _post(server, "/v1/rerank", {"query": QUERY, "documents": ["word " * 200], "truncate_prompt_tokens": 128})
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 128


def test_a_reranker_refuses_embeddings_and_chat(server: ServerProcess) -> None:
    for path, body in (("/v1/embeddings", {"input": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = _post(server, path, body)
        assert r.status_code == 400 and "is a cross-encoder (a reranker)" in r.json()["error"]["message"]


def test_vllm_pair_scores_on_v1_score(server: ServerProcess, model: Path) -> None:
    ref = st.CrossEncoder(str(model), device="cpu").predict([(QUERY, d) for d in DOCS[:3]])
    r = _post(server, "/v1/score", {"model": "reranker", "text_1": QUERY, "text_2": DOCS[:3]})
    assert r.status_code == 200, r.text
    assert [d["score"] for d in r.json()["data"]] == pytest.approx([float(x) for x in ref], abs=1e-5)
    sglang = _post(server, "/v1/score", {"query": QUERY, "items": DOCS[:3]}).json()  # SGLang's spelling
    assert [d["score"] for d in sglang["data"]] == pytest.approx([float(x) for x in ref], abs=1e-5)
    r = _post(server, "/v1/score", {"query": QUERY, "items": DOCS[:1], "label_token_ids": [1]})
    assert r.status_code == 400 and "this model scores pairs" in r.json()["message"]


def test_a_generative_server_refuses_classify(parity_server: ServerProcess) -> None:
    """(A generative server reranks as a yes/no reranker: tests/entrypoints/test_decoder_rerank.py.)"""
    r = _post(parity_server, "/classify", {"input": QUERY})
    assert r.status_code == 400 and "classification needs a cross-encoder server" in r.json()["error"]["message"]


def test_classify_gives_each_inputs_class_probabilities(server: ServerProcess, model: Path) -> None:
    """vLLM's /classify on the one-label cross-encoder: the sigmoid of its logit, as transformers computes it."""
    import torch
    import transformers

    texts = ["what do llamas eat?", "Llamas eat grass and hay."]
    ref_model = transformers.BertForSequenceClassification.from_pretrained(model).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model)
    with torch.no_grad():
        logits = ref_model(**tok(texts, padding=True, return_tensors="pt")).logits[:, 0]
    r = _post(server, "/classify", {"input": texts})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["num_classes"] for d in data] == [1, 1]
    assert [d["probs"][0] for d in data] == pytest.approx(torch.sigmoid(logits).tolist(), abs=1e-5)
    assert _post(server, "/v1/classify", {"input": []}).status_code == 400


def test_pooling_gives_the_cross_encoders_logits(server: ServerProcess, model: Path) -> None:
    """vLLM's /pooling: the model's pooled output as it is (here the logit of each input alone)."""
    import torch
    import transformers

    ref_model = transformers.BertForSequenceClassification.from_pretrained(model).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model)
    with torch.no_grad():
        logit = ref_model(**tok(DOCS[0], return_tensors="pt")).logits[0].tolist()
    r = _post(server, "/pooling", {"input": DOCS[0]})
    assert r.status_code == 200, r.text
    (item,) = r.json()["data"]
    assert item["object"] == "pooling" and item["data"] == pytest.approx(logit, abs=1e-5)
    assert _post(server, "/pooling", {"input": DOCS[0], "dimensions": 4}).status_code == 400
