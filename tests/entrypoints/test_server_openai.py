"""The OpenAI-compatible server end to end: a real `servelm serve` subprocess on a tiny random Llama,
driven by the official `openai` client and raw httpx."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_fixtures import ServerProcess, start_server

pytestmark = pytest.mark.slow  # starts servers, spawns ranks or loads the default model

MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(scope="module")
def server(tiny_llama: tuple[Path, object], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir, _ = tiny_llama
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = start_server(["--model-path", str(model_dir), "--disable-torch-compile", "--max-total-tokens", "16384",
                        "--served-model-name", "tiny", "--tool-call-parser", "hermes"], log)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60,
                         _strict_response_validation=True)


@pytest.fixture(scope="module")
def legacy_client(server: ServerProcess) -> openai.OpenAI:
    """Not strict, for the legacy completions API: the SDK's types want a non-null finish_reason on every
    chunk and a float for every echoed token's logprob, while OpenAI's API (and vLLM, and servelm) stream a
    null finish_reason until the last chunk and echo a null logprob for the first prompt token."""
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def server_info(server: ServerProcess) -> dict:
    r = httpx.get(f"{server.base_url}/server_info", timeout=10)
    assert r.status_code == 200
    return r.json()


def wait_idle(server: ServerProcess, timeout: float = 10.0) -> dict:
    """Wait until no request runs or waits; return server_info then."""
    deadline = time.monotonic() + timeout
    while True:
        info = server_info(server)
        if info["num_running"] == 0 and info["num_waiting"] == 0 and info["num_in_flight"] == 0:
            return info
        assert time.monotonic() < deadline, info
        time.sleep(0.05)


def greedy(**kw: object) -> dict:
    return {"temperature": 0.0, "extra_body": {"ignore_eos": True}, **kw}


# ------------------------------------------------------------- basics
def test_models_and_info(server: ServerProcess, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    r = httpx.get(f"{server.base_url}/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    info = httpx.get(f"{server.base_url}/model_info").json()
    assert info["architecture"] == "LlamaForCausalLM" and info["served_model_name"] == "tiny"
    assert info["max_context_length"] == 1024 and info["vocab_size"] > 1000
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/health_generate", timeout=30).status_code == 200
    assert "servelm ready" in server.log() and "KV capacity 16384 tokens" in server.log()


def test_chat_stream_equals_nonstream_and_usage(server: ServerProcess, client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, **greedy())
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant" and choice.message.content
    n_prompt = httpx.post(f"{server.base_url}/v1/tokenize", json={"messages": MESSAGES}).json()["count"]
    assert full.usage.prompt_tokens == n_prompt
    assert full.usage.completion_tokens == 12 and full.usage.total_tokens == n_prompt + 12

    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}, **greedy()))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == n_prompt
    # The second identical prompt hits the prefix cache.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_max_completion_tokens(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=5, **greedy())
    assert r.usage.completion_tokens == 5


def test_completions_text_token_ids_and_batch(server: ServerProcess, legacy_client: openai.OpenAI) -> None:
    client = legacy_client
    prompt = "The capital of France is"
    ids = httpx.post(f"{server.base_url}/v1/tokenize", json={"prompt": prompt}).json()["tokens"]
    by_text = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, **greedy())
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, **greedy())
    assert by_text.choices[0].text == by_ids.choices[0].text and by_text.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids) and by_text.usage.completion_tokens == 8

    batch = client.completions.create(model="tiny", prompt=[prompt, "Once upon a time"], max_tokens=8, **greedy())
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    assert batch.usage.completion_tokens == 16

    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, stream=True, **greedy())
    assert "".join(c.choices[0].text for c in stream if c.choices) == by_text.choices[0].text

    echoed = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, echo=True, **greedy())
    assert echoed.choices[0].text == prompt + by_text.choices[0].text


def test_stop_strings(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, **greedy())
    text = full.choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 3]
    expected = text[:text.index(stop)]
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, stop=[stop], **greedy())
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, stop=stop,
                                            stream=True, **greedy())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected


def test_seeded_n2_reproducible(client: openai.OpenAI) -> None:
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=10, n=2, temperature=1.0, seed=1234)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    texts_a = [c.message.content for c in sorted(a.choices, key=lambda c: c.index)]
    texts_b = [c.message.content for c in sorted(b.choices, key=lambda c: c.index)]
    assert len(texts_a) == 2 and texts_a == texts_b
    assert texts_a[0] != texts_a[1]  # each sample draws its own stream
    c = client.chat.completions.create(**{**kw, "seed": 99})
    assert [x.message.content for x in sorted(c.choices, key=lambda c: c.index)] != texts_a
    assert a.usage.completion_tokens == 20


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, logprobs=True,
                                       top_logprobs=3, **greedy())
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for tok in content:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 3
        lps = [t.logprob for t in tok.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert tok.top_logprobs[0].token == tok.token and tok.top_logprobs[0].logprob == pytest.approx(tok.logprob)


def test_completion_logprobs_and_echo(server: ServerProcess, legacy_client: openai.OpenAI, tiny_llama) -> None:
    client = legacy_client
    prompt = "Hello there, how are you today?"
    ids = httpx.post(f"{server.base_url}/v1/tokenize", json={"prompt": prompt}).json()["tokens"]
    _, ref = tiny_llama
    import torch

    with torch.no_grad():
        ref_lp = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1)
    expected = [ref_lp[p - 1, ids[p]].item() for p in range(1, len(ids))]

    def check(lp, n_prompt: int) -> None:
        # The echoed prompt is scored too (the first token has nothing before it), as by OpenAI and vLLM.
        assert len(lp.tokens) == n_prompt + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:n_prompt] == pytest.approx(expected, abs=1e-4)
        assert all(x is not None and x <= 0 for x in lp.token_logprobs[n_prompt:])
        # Up to k + 1 alternatives, the token itself always among them (OpenAI's legacy format).
        assert all(2 <= len(t) <= 3 and next(iter(t)) == tok for t, tok in zip(lp.top_logprobs[1:], lp.tokens[1:]))
        assert max(lp.top_logprobs[1].values()) == pytest.approx(ref_lp[0].max().item(), abs=1e-4)
        assert lp.text_offset[0] == 0 and lp.text_offset[n_prompt] == len(prompt)

    # Twice: the second time the prompt is in the prefix cache, which has no logits, so it is recomputed.
    for _ in range(2):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, logprobs=2, echo=True, **greedy())
        assert r.usage.prompt_tokens == len(ids)
        check(r.choices[0].logprobs, len(ids))
        assert "".join(r.choices[0].logprobs.tokens) == r.choices[0].text
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=4, logprobs=2, echo=True,
                                            stream=True, **greedy()))
    lp = chunks[0].choices[0].logprobs
    for c in chunks[1:]:
        if c.choices and c.choices[0].logprobs:
            for name in ("tokens", "token_logprobs", "top_logprobs"):
                getattr(lp, name).extend(getattr(c.choices[0].logprobs, name))
    check(lp, len(ids))
    # The native API asks with sampling_params.prompt_logprobs.
    native = httpx.post(f"{server.base_url}/generate", timeout=30, json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 2, "temperature": 0, "prompt_logprobs": True}}).json()["meta_info"]
    assert native["input_token_logprobs"][0] == [None, ids[0], None]  # SGLang's [logprob, token id, text]
    assert [lp for lp, _, _ in native["input_token_logprobs"][1:]] == pytest.approx(expected, abs=1e-4)
    events = []
    with httpx.stream("POST", f"{server.base_url}/generate", timeout=30, json={
            "input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                                "prompt_logprobs": True}}) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    with_prompt = [e for e in events if "input_token_logprobs" in e["meta_info"]]
    assert len(events) == 3 and len(with_prompt) == 1  # sent once, not with every chunk
    assert [x[0] for x in with_prompt[0]["meta_info"]["input_token_logprobs"][1:]] == pytest.approx(expected, abs=1e-4)
    # Without echo, only the completion is scored.
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, logprobs=2, **greedy())
    assert len(plain.choices[0].logprobs.tokens) == 4
    # max_tokens 0 with echo scores the prompt only (what loglikelihood evaluations send), as legacy OpenAI.
    for stream in (False, True):
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, logprobs=1, echo=True,
                                        stream=stream, temperature=0)
        choice = got.choices[0] if not stream else [c.choices[0] for c in got if c.choices][0]
        assert choice.text == prompt and choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    zero = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, logprobs=1, echo=True)
    assert zero.choices[0].finish_reason == "length" and zero.usage.completion_tokens == 0
    r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": prompt, "max_tokens": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens" and "echo" in r.text


def test_native_generate_tokenize_detokenize(server: ServerProcess) -> None:
    url = server.base_url
    ids = httpx.post(f"{url}/v1/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert httpx.post(f"{url}/v1/detokenize", json={"tokens": ids}).json()["prompt"] == "Hello world"
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/generate", json={"text": "Hello world", "sampling_params": params}, timeout=30).json()
    assert len(r["output_ids"]) == 6 and r["meta_info"]["finish_reason"]["type"] == "length"
    assert r["meta_info"]["prompt_tokens"] == len(ids)
    r2 = httpx.post(f"{url}/generate", json={"input_ids": [ids, ids], "sampling_params": params}, timeout=30).json()
    assert [x["text"] for x in r2] == [r["text"], r["text"]]
    events = []
    with httpx.stream("POST", f"{url}/generate", json={"text": "Hello world", "sampling_params": params,
                                                        "stream": True}, timeout=30) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["text"] == r["text"]  # cumulative text


def test_logit_bias_steers_the_draw(server: ServerProcess, client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="hi", max_tokens=3, logprobs=1, temperature=0,
                                  logit_bias={"1000": 100})
    text = httpx.post(f"{server.base_url}/v1/detokenize", json={"tokens": [1000]}).json()["prompt"]
    assert r.choices[0].logprobs.tokens == [text] * 3
    native = httpx.post(f"{server.base_url}/generate", timeout=30, json={"text": "hi", "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "logit_bias": {"1000": 100}}}).json()
    assert native["output_ids"] == [1000] * 3


# ------------------------------------------------------------ structured outputs
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}


def _follows_schema(text: str) -> bool:
    obj = json.loads(text)
    return set(obj) == {"ok", "color"} and isinstance(obj["ok"], bool) and obj["color"] in ("red", "green", "blue")


def test_structured_outputs(client: openai.OpenAI) -> None:
    """Even a random model's output follows the schema or regex, and stops when the constraint is complete."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=64, response_format=fmt,
                                       temperature=1.0, seed=5, n=3)
    assert len(r.choices) == 3
    for c in r.choices:
        assert _follows_schema(c.message.content) and c.finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=64, response_format=fmt,
                                                 stream=True, temperature=0))
    assert _follows_schema("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices))
    pattern = r"(yes|no)-[0-9]{2}"
    r = client.completions.create(model="tiny", prompt="The answer is", max_tokens=16, temperature=1.0, seed=2,
                                  n=4, extra_body={"regex": pattern})
    for c in r.choices:
        assert re.fullmatch(pattern, c.text) and c.finish_reason == "stop", c.text
    # Without a constraint the same request is free text.
    free = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, **greedy())
    assert free.choices[0].finish_reason == "length"


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": False}}}


def test_tool_calls_named_and_required(client: openai.OpenAI) -> None:
    """A named function or tool_choice="required" is constrained decoding; the output comes back as tool calls."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="tiny", messages=ask, tools=[WEATHER, TIME], tool_choice=named,
                                       max_tokens=64, temperature=0)
    msg = r.choices[0].message
    assert msg.content is None and r.choices[0].finish_reason == "stop" and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call-")
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Oslo") and args["unit"] in ("C", "F")

    r = client.chat.completions.create(model="tiny", messages=ask, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=200, temperature=1.0, seed=3, n=3)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            args = json.loads(call.function.arguments)
            assert (call.function.name, set(args)) in (("get_weather", {"city", "unit"}), ("get_time", {"utc"}))

    r = client.chat.completions.create(model="tiny", messages=ask, tools=[WEATHER, TIME], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=4, n=3)
    assert [len(c.message.tool_calls) for c in r.choices] == [1, 1, 1]

    # Streamed: the call starts with its id and name, then its arguments arrive piece by piece (as vLLM).
    chunks = list(client.chat.completions.create(model="tiny", messages=ask, tools=[WEATHER], tool_choice=named,
                                                 max_tokens=64, temperature=0, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id.startswith("call-") and deltas[0].function.name == "get_weather"
    assert len(deltas) > 3 and all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == call_args(client, ask, named)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    # "required" streams each call of the list the same way, by index.
    chunks = list(client.chat.completions.create(model="tiny", messages=ask, tools=[WEATHER, TIME], n=2, seed=3,
                                                 tool_choice="required", max_tokens=200, temperature=1.0, stream=True))
    whole = client.chat.completions.create(model="tiny", messages=ask, tools=[WEATHER, TIME], n=2, seed=3,
                                           tool_choice="required", max_tokens=200, temperature=1.0)
    for choice in whole.choices:
        streamed: dict[int, list[str]] = {}
        for c in chunks:
            for d in (c.choices[0].delta.tool_calls or []) if c.choices and c.choices[0].index == choice.index else []:
                entry = streamed.setdefault(d.index, [d.function.name, ""])
                entry[1] += d.function.arguments or ""
        assert [(e[0], json.loads(e[1])) for e in streamed.values()] == \
            [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls]

    # Cut off by max_tokens, a "required" list reads as no call: the text stays visible as the content.
    cut = client.chat.completions.create(model="tiny", messages=ask, tools=[WEATHER], tool_choice="required",
                                         max_tokens=3, temperature=0)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.tool_calls is None
    assert cut.choices[0].message.content.startswith("[")

    # Streamed with logprobs: each piece of the arguments comes with its tokens' logprobs.
    chunks = list(client.chat.completions.create(model="tiny", messages=ask, tools=[WEATHER], tool_choice=named,
                                                 max_tokens=64, temperature=0, stream=True, logprobs=True))
    pieces = [c.choices[0] for c in chunks if c.choices and c.choices[0].logprobs]
    assert "".join(t.token for p in pieces for t in p.logprobs.content) == \
        "".join(d.function.arguments or "" for p in pieces for d in p.delta.tool_calls or [])

    # The conversation goes on with the tool's result.
    follow = ask + [{"role": "assistant", "content": None, "tool_calls": [msg.tool_calls[0].model_dump()]},
                    {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": '{"temp": 21}'}]
    r = client.chat.completions.create(model="tiny", messages=follow, tools=[WEATHER], tool_choice="none",
                                       max_tokens=4, temperature=0)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


def test_schemas_are_strict_unless_they_say_otherwise(client: openai.OpenAI) -> None:
    """As vLLM: an object that declares properties takes no others (JSON Schema's default would let the model
    invent keys until max_tokens); an explicit additionalProperties is honoured; json_object may carry a schema."""
    loose = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": loose}}
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=64, response_format=fmt, n=4,
                                       temperature=1.0, seed=5)
    for c in r.choices:
        assert c.finish_reason == "stop" and set(json.loads(c.message.content)) == {"ok"}, c.message.content
    tool = {"type": "function", "function": {"name": "f", "parameters": loose}}
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=64, tools=[tool], n=4,
                                       tool_choice="required", temperature=1.0, seed=5)
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c
        assert [set(json.loads(t.function.arguments)) for t in c.message.tool_calls] == [{"ok"}] * len(
            c.message.tool_calls)
    # json_object with a schema (llama.cpp, Together and old instructor send it): enforced.
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=64, n=4, temperature=1.0, seed=5,
                                       response_format={"type": "json_object", "schema": loose})
    for c in r.choices:
        assert c.finish_reason == "stop" and set(json.loads(c.message.content)) == {"ok"}, c.message.content
    # Explicitly open: other keys are allowed (a random model writes some, given room).
    open_schema = {**loose, "additionalProperties": {"type": "integer"}}
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=64, n=8, temperature=1.0, seed=5,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "o", "schema": open_schema}})
    keys = [set(json.loads(c.message.content)) for c in r.choices if c.finish_reason == "stop"]
    assert any(k - {"ok"} for k in keys), keys


def test_tool_choice_auto_reads_the_models_own_calls(client: openai.OpenAI) -> None:
    """With --tool-call-parser hermes, auto leaves the model free; a random model writes no call, so its text
    comes back as content, streamed or not (the parser itself is tested in test_tool_calls.py)."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="tiny", messages=ask, tools=[WEATHER], max_tokens=12, **greedy())
    msg = r.choices[0].message
    assert msg.tool_calls is None and msg.content and r.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model="tiny", messages=ask, tools=[WEATHER], tool_choice="auto",
                                                 max_tokens=12, stream=True, **greedy()))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-1].choices[0].finish_reason == "length"


def call_args(client: openai.OpenAI, messages: list, choice: dict) -> str:
    r = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], tool_choice=choice,
                                       max_tokens=64, temperature=0)
    return r.choices[0].message.tool_calls[0].function.arguments


# ------------------------------------------------------------ bad input
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    (CHAT, b"{not json", 400, "body"),
    (CHAT, b"", 400, "body"),
    (CHAT, {"max_tokens": 4}, 400, "messages"),
    (CHAT, {"messages": "hello"}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": MSG, "max_tokens": "many"}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": -3}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "temperature": -0.5}, 400, "temperature"),
    (CHAT, {"messages": MSG, "top_p": 0}, 400, "top_p"),
    (CHAT, {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
    (CHAT, {"messages": MSG, "n": 0}, 400, "n"),
    (CHAT, {"messages": MSG, "n": 1000}, 400, "n"),
    (CHAT, {"messages": MSG, "top_logprobs": 3}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "max_tokens": 5000}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "model": "gpt-4"}, 404, "model"),
    (CHAT, {"messages": MSG, "stop": [""]}, 400, "stop"),
    (CHAT, {"messages": MSG, "temperature": float("nan")}, 400, "temperature"),
    (CHAT, {"messages": [{"content": "no role"}]}, 400, "messages"),
    (CMPL, {"prompt": "x " * 1100, "max_tokens": 4}, 400, "prompt"),
    (CMPL, {"prompt": [1, 2, -7]}, 400, "prompt"),
    (CMPL, {"prompt": [1, 10_000_000]}, 400, "prompt"),
    (CMPL, {"prompt": []}, 400, "prompt"),
    (CMPL, {"prompt": 5}, 400, "prompt"),
    (CMPL, {"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    (CMPL, {"prompt": "hi", "frequency_penalty": 7}, 400, "frequency_penalty"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": "hot"}}, 400, "sampling_params.temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"bogus": 1}}, 400, "sampling_params.bogus"),
    ("/generate", {"input_ids": [99_999_999]}, 400, "input_ids"),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": float("inf")}}, 400, "sampling_params.top_p"),
    ("/v1/detokenize", {"tokens": [-1]}, 400, "tokens"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, 400, "response_format"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    (CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, 400, "response_format"),
    (CMPL, {"prompt": "hi", "regex": "(ab"}, 400, "regex"),
    (CMPL, {"prompt": "hi", "regex": "a", "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("/generate", {"text": "hi", "sampling_params": {"json_schema": "{not json"}}, 400, "sampling_params.json_schema"),
    (CHAT, {"messages": MSG, "tools": [WEATHER], "tool_choice": "sometimes"}, 400, "tool_choice"),
    (CHAT, {"messages": MSG, "logit_bias": {"99999999": 5}}, 400, "logit_bias"),
    (CMPL, {"prompt": "hi", "suffix": "world"}, 400, "suffix"),
    (CMPL, {"prompt": "hi", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    (CMPL, {"prompt": "hi", "logit_bias": {"five": 1}}, 400, "logit_bias"),
    (CHAT, {"messages": MSG, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]}, 400, "tools"),
    (CHAT, {"messages": [*MSG, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, 400, "messages"),
    (CHAT, {"messages": MSG, "tool_choice": "required"}, 400, "tool_choice"),
    (CHAT, {"messages": MSG, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     400, "tool_choice"),
    (CHAT, {"messages": MSG, "tools": [WEATHER], "tool_choice": "required",
            "response_format": {"type": "json_object"}}, 400, "response_format"),
    # Unknown fields are named, never dropped (a misspelt max_tokens would run with the default).
    (CMPL, {"prompt": "hi", "max_token": 3}, 400, "max_token"),
    (CHAT, {"messages": MSG, "max_tokens": 2, "maxtokens": 2, "temprature": 0}, 400, "maxtokens"),
    (CHAT, {"messages": MSG, "guided_decoding_backend": "xgrammar"}, 400, "guided_decoding_backend"),
    ("/generate", {"text": "hi", "lora_path": "x"}, 400, "lora_path"),
    ("/v1/tokenize", {"prompt": "hi", "add_bos": True}, 400, "add_bos"),
    # A text-only model says so instead of dropping the image.
    (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400, "messages"),
    (CHAT, {"messages": MSG, "modalities": ["text", "audio"]}, 400, "modalities"),
    (CMPL, {"prompt": "hi", "best_of": 3}, 400, "best_of"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS,
                         ids=[f"{p}-{i}" for i, (p, *_rest) in enumerate(BAD_REQUESTS)])
def test_bad_input_is_4xx_in_openai_shape(server: ServerProcess, path: str, body: object, status: int,
                                          param: str) -> None:
    # json.dumps, not httpx's json=, so that NaN/Infinity reach the server as Python's json writes them.
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.base_url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["message"]
    if param not in ("body",):
        assert param.split(".")[-1] in err["message"] or "context length" in err["message"]


def test_unknown_fields_are_named(server: ServerProcess, client: openai.OpenAI) -> None:
    r = httpx.post(f"{server.base_url}{CMPL}", json={"prompt": "hi", "max_token": 3}, timeout=30)
    assert r.json()["error"]["message"] == "Unrecognized request argument supplied: max_token"
    r = httpx.post(f"{server.base_url}{CHAT}", json={"messages": MSG, "b": 1, "a": 2}, timeout=30)
    assert r.json()["error"]["message"] == "Unrecognized request arguments supplied: b, a"
    r = httpx.post(f"{server.base_url}{CHAT}", json={"messages": MSG, "length_penalty": 1.0}, timeout=30)
    assert r.json()["error"]["message"] == "'length_penalty': a vLLM/SGLang extension that servelm does not support yet"
    # OpenAI's own fields that change nothing here, and the extensions servelm implements, are accepted.
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, user="u1", store=False,
                                       metadata={"k": "v"}, service_tier="auto", modalities=["text"],
                                       extra_body={"top_k": 5, "min_p": 0.1, "ignore_eos": True,
                                                   "repetition_penalty": 1.1, "skip_special_tokens": True,
                                                   "chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.completion_tokens == 2
    r = client.completions.create(model="tiny", prompt="hi", max_tokens=2, user="u1", best_of=1,
                                  extra_body={"top_k": 5, "min_tokens": 1, "regex": "[a-z ]+"})
    assert r.choices[0].text


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=-1)
    assert exc.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)


def test_still_serving_after_bad_input(server: ServerProcess, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, **greedy())
    assert r.usage.completion_tokens == 3
    assert wait_idle(server)["kv_integrity_ok"] is True


# --------------------------------------------------------- concurrency
def test_16_concurrent_streams(server: ServerProcess, client: openai.OpenAI) -> None:
    aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = [f"Count to {i} and then say why." for i in range(16)]

    async def one(prompt: str) -> str:
        stream = await aclient.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=16, stream=True, **greedy())
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def all_streams() -> list[str]:
        return await asyncio.gather(*(one(p) for p in prompts))

    texts = asyncio.run(all_streams())
    alone = [client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}],
                                            max_tokens=16, **greedy()).choices[0].message.content
             for p in prompts[:4]]
    assert texts[:4] == alone
    assert all(texts)
    assert wait_idle(server)["kv_integrity_ok"] is True


def test_hangups_abort_and_free_kv(server: ServerProcess) -> None:
    before = server_info(server)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 900, "temperature": 0, "ignore_eos": True,
            "stream": True}
    for _ in range(4):
        with httpx.stream("POST", f"{server.base_url}{CHAT}", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
        # Leaving the block closes the connection mid-stream.
    # A non-streaming request whose client gives up.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}{CHAT}", json={**body, "stream": False}, timeout=0.5)
    info = wait_idle(server, timeout=10)
    assert info["kv_integrity_ok"] is True and info["kv_in_use_tokens"] == 0
    assert info["aborted_total"] - before["aborted_total"] == 5
    # They were cut short: far fewer tokens than 5 x 900 were generated.
    assert info["generation_tokens_total"] - before["generation_tokens_total"] < 5 * 900 / 2
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert 'servelm:num_aborted_requests_total{model_name="tiny"}' in metrics


def test_abort_request_endpoint(server: ServerProcess) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 900, "temperature": 0, "ignore_eos": True,
            "stream": True}
    finish = None
    with httpx.stream("POST", f"{server.base_url}{CHAT}", json=body, timeout=30) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if finish is None:
                finish = "sent"
                r = httpx.post(f"{server.base_url}/abort_request", json={"rid": chunk["id"]})
                assert r.json() == {"success": True}
            if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                finish = chunk["choices"][0]["finish_reason"]
    assert finish == "abort"
    assert wait_idle(server)["kv_integrity_ok"] is True


def test_metrics_and_flush_cache(server: ServerProcess, client: openai.OpenAI) -> None:
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, **greedy())
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in ("servelm:time_to_first_token_seconds_bucket", "servelm:inter_token_latency_seconds_bucket",
                 "servelm:e2e_request_latency_seconds_count", "servelm:prompt_tokens_total",
                 "servelm:generation_tokens_total", "servelm:cached_tokens_total", "servelm:num_requests_total",
                 "servelm:num_requests_running", "servelm:num_requests_waiting", "servelm:token_usage",
                 "servelm:cache_hit_rate", "servelm:kv_total_tokens"):
        assert name in text, name
    assert 'servelm:kv_total_tokens{model_name="tiny"} 16384.0' in text
    assert "_created" not in text  # no creation-timestamp series
    import servelm

    assert httpx.get(f"{server.base_url}/version").json() == {"version": servelm.__version__}
    wait_idle(server)
    r = httpx.post(f"{server.base_url}/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True
    info = server_info(server)
    assert info["kv_cached_tokens"] == 0 and info["kv_integrity_ok"] is True
    assert info["server_args"]["served_model_name"] == "tiny"


def test_duplicate_rid_is_400(server: ServerProcess) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 900, "ignore_eos": True, "stream": True,
            "rid": "dup-rid"}
    with httpx.stream("POST", f"{server.base_url}{CHAT}", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        r = httpx.post(f"{server.base_url}{CHAT}", json={**body, "stream": False}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "rid"
    assert wait_idle(server)["kv_integrity_ok"] is True


def test_rid_of_a_sub_request_is_not_taken_over(server: ServerProcess) -> None:
    """A running `cl-0`; then `cl` with n=2 (its choice 0 would be `cl-0`) is a 400, an abort of `cl`
    touches nothing, and `cl-0` completes with all its tokens."""
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 60, "temperature": 0, "ignore_eos": True,
            "stream": True, "rid": "cl-0"}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        r = httpx.post(f"{server.base_url}/v1/completions", json={**body, "stream": False, "rid": "cl", "n": 2},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "rid" and "'cl-0'" in r.text
        assert httpx.post(f"{server.base_url}/abort_request", json={"rid": "cl"}).json() == {"success": False}
        chunks = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # More sequences than the server can ever run at once (64 running + 256 queued): not a 429 to retry forever.
    r = httpx.post(f"{server.base_url}/v1/completions", json={**body, "stream": False, "rid": None, "n": 128,
                                                               "prompt": ["a", "b", "c"], "max_tokens": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    info = wait_idle(server)
    assert info["kv_integrity_ok"] is True and info["num_in_flight"] == 0


# ----------------------------------------------------------- benchmark
@pytest.mark.parametrize("dataset", ["random", "generated-shared-prefix"])
def test_bench_serving(server: ServerProcess, tiny_llama: tuple[Path, object], tmp_path: Path,
                       capsys: pytest.CaptureFixture[str], dataset: str) -> None:
    from servelm.bench import serving

    out = tmp_path / "bench.jsonl"
    argv = ["--base-url", server.base_url, "--tokenizer", str(tiny_llama[0]), "--dataset-name", dataset,
            "--output-file", str(out)]
    if dataset == "random":
        argv += ["--num-prompts", "8", "--random-input-len", "32", "--random-output-len", "8",
                 "--random-range-ratio", "0.5", "--max-concurrency", "4"]
        expected_requests = 8
    else:
        argv += ["--gsp-num-groups", "2", "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "64",
                 "--gsp-question-len", "8", "--gsp-output-len", "4", "--request-rate", "50"]
        expected_requests = 6
    assert serving.main(argv) == 0
    printed = capsys.readouterr().out
    for label in ("Successful requests:", "Benchmark duration (s):", "Output token throughput (tok/s):",
                  "Median TTFT (ms):", "P99 TTFT (ms):", "P95 ITL (ms):", "Median E2E Latency (ms):"):
        assert label in printed
    record = json.loads(out.read_text().splitlines()[-1])
    assert record["completed"] == expected_requests and record["failed"] == 0
    assert record["model"] == "tiny" and record["output_throughput"] > 0 and record["mean_ttft_ms"] > 0
    if dataset == "random":
        assert 4 * 8 <= record["total_output_tokens"] <= 8 * 8
        assert 16 * 8 <= record["total_input_tokens"] <= 32 * 8
    else:
        assert record["total_output_tokens"] == 6 * 4 and record["total_input_tokens"] == 6 * 72


def test_bench_serving_flush_cache(server: ServerProcess, tiny_llama: tuple[Path, object]) -> None:
    """The same seed twice hits the prefix cache; --flush-cache makes the second run start cold."""
    from servelm.bench import serving

    argv = ["--base-url", server.base_url, "--tokenizer", str(tiny_llama[0]), "--num-prompts", "4",
            "--random-input-len", "24", "--random-output-len", "2", "--seed", "77"]

    def cached_during(extra: list[str]) -> int:
        before = server_info(server)["cached_tokens_total"]
        assert serving.main(argv + extra) == 0
        return server_info(server)["cached_tokens_total"] - before

    cached_during(["--flush-cache"])
    assert cached_during([]) >= 4 * 20  # the prompts again: nearly all cached
    assert cached_during(["--flush-cache"]) == 0
