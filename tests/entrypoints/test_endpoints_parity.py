"""SGLang/vLLM endpoints and metric families (issue 15, items 5 and 6), over real HTTP on a tiny random Llama:
/v1/score (checked against the HF reference model), /version, /load, /invocations, /ping, /get_server_info,
and the vLLM metric families fed by real scheduler events (retraction included: the KV pool is small)."""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from servelm import __version__
from tests.entrypoints.conftest import PARITY_KV_TOKENS as KV_TOKENS
from tests.server_fixtures import ServerProcess

pytestmark = pytest.mark.slow  # starts servers, spawns ranks or loads the default model


@pytest.fixture(scope="module")
def server(parity_server: ServerProcess) -> ServerProcess:
    return parity_server


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def tokenize(http: httpx.Client, text: str) -> list[int]:
    return http.post("/v1/tokenize", json={"prompt": text}).json()["tokens"]


def reference_logprobs(model: torch.nn.Module, ids: list[int], labels: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    return logits.log_softmax(-1)[labels].tolist()


# ------------------------------------------------------------------ /v1/score
def test_score_matches_the_reference_model(http: httpx.Client, tiny_llama: tuple[Path, torch.nn.Module]) -> None:
    _, model = tiny_llama
    query, items = "The capital of France is", [" Paris", " London", " Berlin"]
    labels = tokenize(http, " yes")[-1:] + tokenize(http, " no")[-1:] + [7]
    r = http.post("/v1/score", json={"query": query, "items": items, "label_token_ids": labels, "model": "tiny"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "scoring" and body["model"] == "tiny" and len(body["scores"]) == 3
    for item, scores in zip(items, body["scores"]):
        expected = reference_logprobs(model, tokenize(http, query + item), labels)
        assert [math.log(s) for s in scores] == pytest.approx(expected, abs=2e-3)
    assert body["usage"]["prompt_tokens"] == sum(len(tokenize(http, query + item)) for item in items)

    soft = http.post("/v1/score", json={"query": query, "items": items[:1], "label_token_ids": labels,
                                        "apply_softmax": True}).json()["scores"][0]
    raw = body["scores"][0]
    assert sum(soft) == pytest.approx(1.0) and soft == pytest.approx([s / sum(raw) for s in raw], rel=1e-4)


def test_score_token_ids_and_item_first(http: httpx.Client, tiny_llama: tuple[Path, torch.nn.Module]) -> None:
    _, model = tiny_llama
    query, items, labels = [10, 20, 30], [[40, 50], [60]], [1, 2]
    first = http.post("/v1/score", json={"query": query, "items": items, "label_token_ids": labels,
                                         "item_first": True}).json()["scores"]
    for item, scores in zip(items, first):
        expected = reference_logprobs(model, item + query, labels)
        assert [math.log(s) for s in scores] == pytest.approx(expected, abs=2e-3)
    after = http.post("/v1/score", json={"query": query, "items": items, "label_token_ids": labels}).json()["scores"]
    assert [math.log(s) for s in after[0]] == pytest.approx(reference_logprobs(model, query + items[0], labels),
                                                            abs=2e-3)


@pytest.mark.parametrize(("body", "param"), [
    ({"query": "q", "items": ["a"], "label_token_ids": []}, "label_token_ids"),
    ({"query": "q", "items": ["a"], "label_token_ids": [10**9]}, "label_token_ids"),
    ({"query": "q", "items": [[1, 2]], "label_token_ids": [1]}, "items"),
    ({"query": [1], "items": ["a"], "label_token_ids": [1]}, "items"),
    ({"query": "q", "items": [], "label_token_ids": [1]}, "items"),
    ({"query": "q", "items": ["a"] * 321, "label_token_ids": [1]}, "items"),  # more than the server runs at once
    ({"query": "q", "items": ["a"], "label_token_ids": [1], "bogus": 1}, "bogus"),
    ({"query": "q", "items": ["a"], "label_token_ids": [1], "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ({"items": ["a"], "label_token_ids": [1]}, "query"),
])
def test_score_bad_requests(http: httpx.Client, body: dict, param: str) -> None:
    r = http.post("/v1/score", json=body)
    assert r.status_code == 400, r.text
    error = r.json()  # SGLang's flat shape on its route
    assert error["object"] == "error" and error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == param and error["message"]
    if body.get("label_token_ids") == [10**9]:
        vocab = http.get("/get_model_info").json().get("vocab_size") or http.get("/server_info").json()["vocab_size"]
        assert error["message"] == f"Token ID {10**9} is out of vocabulary (vocab size: {vocab})"


# ------------------------------------------------------- small endpoints
def test_version_ping_load_and_server_info(http: httpx.Client) -> None:
    assert http.get("/version").json() == {"version": __version__}
    assert http.get("/ping").status_code == 200
    assert http.get("/load").json() == {"server_load": 0}
    info = http.get("/get_server_info").json()
    assert info["max_total_num_tokens"] == KV_TOKENS == info["kv_total_tokens"]
    assert http.get("/server_info").json()["max_total_num_tokens"] == KV_TOKENS


def test_load_counts_requests_in_flight(server: ServerProcess) -> None:
    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            body = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
            tasks = [asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(2)]
            loads = []
            while not all(t.done() for t in tasks):
                loads.append((await client.get("/load")).json()["server_load"])
                await asyncio.sleep(0.01)
            assert all(t.result().status_code == 200 for t in tasks)
            loads.append((await client.get("/load")).json()["server_load"])
            return loads

    loads = asyncio.run(run())
    assert max(loads) == 2 and loads[-1] == 0


def test_invocations_route_by_body(http: httpx.Client) -> None:
    chat = http.post("/invocations", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                                           "temperature": 0})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    direct = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 3, "temperature": 0}).json()
    assert chat.json()["choices"][0]["message"] == direct["choices"][0]["message"]
    comp = http.post("/invocations", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert comp.status_code == 200 and comp.json()["object"] == "text_completion"
    stream = http.post("/invocations", json={"prompt": "Hello", "max_tokens": 3, "stream": True})
    assert stream.text.rstrip().endswith("data: [DONE]")
    for body, param in [({"input": "x"}, "body"), ([1, 2], "body"), ({"prompt": "x", "max_tokenz": 3}, "max_tokenz"),
                        ({"messages": "nope"}, "messages")]:
        r = http.post("/invocations", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    for raw in (b"{not json", b"\xff\xfe"):  # malformed JSON, not UTF-8: a 400, not a 500
        r = http.post("/invocations", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "body", r.text


# ------------------------------------------------------------------ metrics
def metric(text: str, name: str) -> float:
    """The value of `servelm:<name>{model_name="tiny"...}` (the first sample of that name)."""
    match = re.search(rf'^servelm:{re.escape(name)}\{{model_name="tiny"[^}}]*\}} (\S+)$', text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_vllm_metric_families(server: ServerProcess, http: httpx.Client) -> None:
    before = http.get("/metrics").text
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)

    async def run() -> None:
        # Four requests of ~150 tokens each overflow the 512-token KV pool: the scheduler must retract.
        await asyncio.gather(*(client.completions.create(model="tiny", prompt=f"Story {i}:", max_tokens=150,
                                                         temperature=0, extra_body={"ignore_eos": True})
                               for i in range(4)))

    asyncio.run(run())
    text = http.get("/metrics").text
    assert metric(text, "num_preemptions_total") > 0 and "retracted request" in server.log()
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "time_per_output_token_seconds"):
        assert metric(text, f"{name}_count") - _count(before, f"{name}_count") == 4, name
    # Every scheduler step: prompt tokens once, plus one token per output token (recomputation after
    # retraction counts again, so at least).
    steps = metric(text, "iteration_tokens_total_sum") - _count(before, "iteration_tokens_total_sum")
    assert steps >= 4 * 150
    assert metric(text, "iteration_tokens_total_count") > _count(before, "iteration_tokens_total_count")
    assert 'servelm:iteration_tokens_total_bucket{le="1.0",model_name="tiny"}' in text
    usage = metric(text, "kv_cache_usage_perc")
    assert 0.0 <= usage <= 1.0 and usage == metric(text, "token_usage") == metric(text, "gpu_cache_usage_perc")
    # vLLM's per-request families: four requests of max_tokens 150, each generating all 150 (ignore_eos)
    for name, value in (("request_prompt_tokens_count", 4), ("request_generation_tokens_sum", 600),
                        ("request_params_max_tokens_sum", 600), ("request_params_n_sum", 4),
                        ("request_inference_time_seconds_count", 4)):
        assert metric(text, name) - _count(before, name) == value, name
    prompts = metric(text, "request_prompt_tokens_sum") - _count(before, "request_prompt_tokens_sum")
    assert metric(text, "prefix_cache_queries_total") - _count(before, "prefix_cache_queries_total") == prompts
    assert metric(text, "gpu_prefix_cache_hits_total") == metric(text, "prefix_cache_hits_total")
    assert re.search(r'^servelm:request_success_total\{finished_reason="length",model_name="tiny"\} \d', text, re.M)
    assert re.search(r'^servelm:cache_config_info\{block_size="\d+",cache_dtype="float32",enable_prefix_caching="True",'
                     r'num_cpu_blocks="None",num_gpu_blocks="\d+"\} 1\.0$', text, re.M)
    assert "# TYPE servelm:kv_cache_usage_perc gauge" in text


def _count(text: str, name: str) -> float:
    match = re.search(rf'^servelm:{re.escape(name)}\{{model_name="tiny"[^}}]*\}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0
