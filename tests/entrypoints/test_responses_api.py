"""OpenAI's Responses API (`/v1/responses`) over real HTTP with the official `openai` client, on a tiny random
Llama: create (text or messages, instructions, max_output_tokens, text.format json_schema), stream, background,
retrieve, cancel, delete, previous_response_id, function tools (calls out, their results back in), the bounded
store, and 4xx for what it does not take."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from servelm.entrypoints.responses_protocol import ResponseObject
from servelm.entrypoints.serving_responses import ResponseStore, Stored
from tests.server_fixtures import ServerProcess

pytestmark = pytest.mark.slow  # starts servers, spawns ranks or loads the default model


@pytest.fixture(scope="module")
def server(parity_server: ServerProcess) -> ServerProcess:
    return parity_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60,
                         _strict_response_validation=True)


def chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> str:
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content or ""


def prompt_tokens(server: ServerProcess, messages: list[dict]) -> int:
    return httpx.post(f"{server.base_url}/v1/tokenize", json={"messages": messages}, timeout=30).json()["count"]


def wait_finished(client: openai.OpenAI, response_id: str, timeout: float = 60.0) -> openai.types.responses.Response:
    deadline = time.monotonic() + timeout
    while True:
        r = client.responses.retrieve(response_id)
        if r.status not in ("queued", "in_progress") and r.usage is not None:
            return r
        assert time.monotonic() < deadline, r
        time.sleep(0.05)


def test_create_and_retrieve(server: ServerProcess, client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Tell me a story."}]
    r = client.responses.create(model="tiny", input="Tell me a story.", instructions="Answer briefly.",
                                max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == chat_text(client, messages, 8) and r.output_text
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.output_tokens == 8 and r.usage.input_tokens == prompt_tokens(server, messages)
    assert r.usage.total_tokens == r.usage.input_tokens + 8
    again = client.responses.retrieve(r.id)
    assert again.output_text == r.output_text and again.status == "incomplete"
    assert again.instructions == "Answer briefly."
    # A list of input messages (content as a string or input_text parts) is the same conversation.
    listed = client.responses.create(model="tiny", max_output_tokens=8, temperature=0, input=[
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "input_text", "text": "Tell me a story."}]}])
    assert listed.output_text == r.output_text


def test_stream_events(client: openai.OpenAI) -> None:
    full = client.responses.create(model="tiny", input="Once upon a time", max_output_tokens=10, temperature=0)
    events = list(client.responses.create(model="tiny", input="Once upon a time", max_output_tokens=10,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == full.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == full.output_text
    final = events[-1].response
    assert final.status == "incomplete" and final.output_text == full.output_text and final.usage.output_tokens == 10
    assert client.responses.retrieve(final.id).output_text == full.output_text  # stored once it finished


def test_json_schema_format(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.responses.create(model="tiny", input="Is it ok?", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                                                 "strict": True}})
    assert r.status == "completed" and set(json.loads(r.output_text)) == {"ok"}
    assert r.text.format.type == "json_schema"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", input="x", text={"format": {"type": "json_schema", "name": "a",
                                                                         "schema": {"type": "nonsense"}}})
    assert err.value.body["param"].startswith("text.format")


def test_previous_response_id_continues_the_conversation(server: ServerProcess, client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny", input="Hi", max_output_tokens=5, temperature=0)
    second = client.responses.create(model="tiny", input="And then?", previous_response_id=first.id,
                                     max_output_tokens=5, temperature=0)
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "And then?"}]
    assert second.usage.input_tokens == prompt_tokens(server, conversation)
    assert second.output_text == chat_text(client, conversation, 5)
    assert second.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="x", previous_response_id="resp_missing", max_output_tokens=2)


CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"type": "function", "name": "weather", "description": "Weather in a city", "parameters": CITY}


def test_a_named_function_call_and_its_result_in_the_next_turn(server: ServerProcess, client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER], max_output_tokens=24,
                                    tool_choice={"type": "function", "name": "weather"}, temperature=0)
    assert [item.type for item in first.output] == ["function_call"] and first.status == "completed"
    call = first.output[0]
    assert call.name == "weather" and call.call_id and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    assert first.tool_choice.name == "weather" and first.tools[0].name == "weather"
    # the result goes back with previous_response_id; the model sees it as a tool message
    second = client.responses.create(model="tiny", previous_response_id=first.id, max_output_tokens=4, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "22 C and sunny"}])
    turns = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": ""},
             {"role": "tool", "content": "22 C and sunny"}]
    assert second.usage.input_tokens == prompt_tokens(server, turns)
    assert [item.type for item in second.output] == ["message"]
    # the same conversation sent whole, the call as an input item
    whole = client.responses.create(model="tiny", max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": "weather", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "22 C and sunny"}])
    assert whole.usage.input_tokens == second.usage.input_tokens and whole.output_text == second.output_text


def test_required_calls_and_their_stream_events(server: ServerProcess, client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", input="Weather?", tools=[WEATHER], tool_choice="required",
                                max_output_tokens=40, temperature=0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and all(c.name == "weather" and json.loads(c.arguments)["city"] for c in calls)
    events = []
    with httpx.stream("POST", f"{server.base_url}/v1/responses", timeout=60, json={
            "model": "tiny", "input": "Weather?", "tools": [WEATHER], "tool_choice": "required",
            "max_output_tokens": 40, "temperature": 0, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    kinds = [e["type"] for e in events]
    assert "response.output_text.delta" not in kinds  # the output is the calls
    args = [e["arguments"] for e in events if e["type"] == "response.function_call_arguments.done"]
    assert args == [c.arguments for c in calls]
    assert "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta") == \
        "".join(args)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [d["type"] for d in done] == ["function_call"] * len(calls)
    assert kinds[-1] == "response.completed"
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["function_call"] * len(calls)


def test_truncation_sampling_extras_and_id_checks(server: ServerProcess, client: openai.OpenAI) -> None:
    context = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    long_turn = "word " * (context // 2 + 50)
    turns = [{"role": "user", "content": long_turn}, {"role": "assistant", "content": long_turn},
             {"role": "user", "content": "And now?"}]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input=turns, max_output_tokens=4)
    r = client.responses.create(model="tiny", input=turns, max_output_tokens=4, truncation="auto", temperature=0)
    assert r.truncation == "auto" and r.status in ("completed", "incomplete")
    assert r.usage.input_tokens <= context - 4
    assert r.usage.input_tokens == prompt_tokens(server, turns[1:])  # the first turn alone went
    plain = client.responses.create(model="tiny", input="Count: one two", max_output_tokens=12, temperature=0)
    assert plain.truncation == "disabled"
    cut = plain.output_text[2:6]
    stopped = client.responses.create(model="tiny", input="Count: one two", max_output_tokens=12, temperature=0,
                                      extra_body={"stop": [cut], "top_k": 5, "min_p": 0.0,
                                                  "repetition_penalty": 1.0, "frequency_penalty": 0.0,
                                                  "presence_penalty": 0.0})
    assert stopped.output_text == plain.output_text[:plain.output_text.index(cut)]
    r = httpx.post(f"{server.base_url}/v1/responses", timeout=30,
                   json={"model": "tiny", "input": "x", "previous_response_id": "abc"})
    assert r.status_code == 400 and "Expected an ID that begins with 'resp'" in r.json()["error"]["message"]


def test_background_cancel_and_delete(server: ServerProcess, client: openai.OpenAI) -> None:
    done = client.responses.create(model="tiny", input="Hello", max_output_tokens=6, temperature=0, background=True)
    assert done.status in ("queued", "in_progress") and done.background
    finished = wait_finished(client, done.id)
    sync = client.responses.create(model="tiny", input="Hello", max_output_tokens=6, temperature=0)
    assert finished.status == "incomplete" and finished.output_text == sync.output_text

    long = client.responses.create(model="tiny", input="Write a long story.", max_output_tokens=450,
                                   temperature=0, background=True)
    with pytest.raises(openai.BadRequestError, match="still"):  # no continuing a response before it ends
        client.responses.create(model="tiny", input="x", previous_response_id=long.id, max_output_tokens=2)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    after = wait_finished(client, long.id)
    assert after.status == "cancelled" and after.usage.output_tokens < 450
    assert httpx.get(f"{server.base_url}/load", timeout=10).json() == {"server_load": 0}
    with pytest.raises(openai.BadRequestError):  # finished: nothing to cancel
        client.responses.cancel(long.id)

    client.responses.delete(long.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(long.id)
    unstored = client.responses.create(model="tiny", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "bogus": 1}, "bogus"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tool_choice"),  # auto needs a parser
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "type": "function_call_output", "content": "x"}]}, "input"),
    ({"input": "x", "model": "other"}, "model"),
])
def test_bad_requests(server: ServerProcess, body: dict, param: str) -> None:
    r = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_store_is_bounded_lru() -> None:
    store = ResponseStore(size=2)
    a, b, c = (Stored(ResponseObject(model="m", status="completed"), []) for _ in range(3))
    store.put(a)
    store.put(b)
    store.get(a.response.id)  # a is now the most recently used
    store.put(c)
    assert len(store) == 2 and store.get(a.response.id) is a and store.get(c.response.id) is c
    with pytest.raises(Exception, match="not found"):
        store.get(b.response.id)


def test_store_never_evicts_a_response_still_running() -> None:
    store = ResponseStore(size=1)
    running = Stored(ResponseObject(model="m", status="in_progress"), [])
    done = Stored(ResponseObject(model="m", status="completed"), [])
    newer = Stored(ResponseObject(model="m", status="in_progress"), [])
    store.put(running)
    store.put(done)  # over the limit, but the only finished one is the newest: nothing else may go
    assert store.get(running.response.id) is running
    store.put(newer)
    assert store.get(running.response.id) is running and store.get(newer.response.id) is newer
    with pytest.raises(Exception, match="not found"):
        store.get(done.response.id)
