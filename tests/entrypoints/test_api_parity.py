"""vLLM/SGLang request extensions over real HTTP (issue 15): constraints in every spelling, logprob formats,
token ids, streaming options, validation, beam search refused. One server on a tiny random Llama; its KV pool
(512 tokens) is smaller than --context-length (768), which the API still reports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_fixtures import ServerProcess, sse_events, start_server

pytestmark = pytest.mark.slow  # starts servers, spawns ranks or loads the default model

MESSAGES = [{"role": "user", "content": "Name a color."}]
CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}
CHOICES = ["red", "green", "blue sky"]


@pytest.fixture(scope="module")
def server(tiny_llama: tuple[Path, object], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir, _ = tiny_llama
    log = tmp_path_factory.mktemp("parity") / "server.log"
    srv = start_server(["--model-path", str(model_dir), "--disable-torch-compile", "--max-total-tokens", "512",
                        "--context-length", "768", "--served-model-name", "x"], log)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def error(server: ServerProcess, path: str, body: dict) -> dict:
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    return r.json()["error"]


# ---------------------------------------------------------------- 1. constraints
CHOICE_SPELLINGS = [{"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}},
                    {"regex": "red|green|blue sky"}, {"guided_regex": "red|green|blue sky"},
                    {"structured_outputs": {"regex": "red|green|blue sky"}},
                    {"ebnf": 'root ::= "red" | "green" | "blue sky"'}, {"guided_grammar": 'start: "red" | "green"'},
                    {"structured_outputs": {"grammar": 'start: "red" | "green" | "blue sky"'}}]
JSON_SPELLINGS = [{"guided_json": SCHEMA}, {"json_schema": json.dumps(SCHEMA)},
                  {"structured_outputs": {"json": SCHEMA}},
                  {"guided_json": json.dumps(SCHEMA), "guided_whitespace_pattern": "[ ]?"}]


@pytest.mark.parametrize("body", CHOICE_SPELLINGS + JSON_SPELLINGS, ids=lambda b: "+".join(b))
def test_constraints_in_every_spelling(client: openai.OpenAI, body: dict) -> None:
    """A random model's output follows the constraint, on chat (3 samples) and completions alike."""
    chat = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=40, temperature=1.0, seed=3,
                                          n=3, extra_body=body)
    cmpl = client.completions.create(model="x", prompt="Color:", max_tokens=40, temperature=1.0, seed=4,
                                     extra_body=body)
    for text in [c.message.content for c in chat.choices] + [cmpl.choices[0].text]:
        if "json" in "".join(body) or "json" in json.dumps(body.get("structured_outputs", {})):
            obj = json.loads(text)
            assert set(obj) == {"ok", "color"} and obj["color"] in ("red", "blue"), text
        else:
            assert text in CHOICES, text


def test_json_object_and_native_constraints(server: ServerProcess, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=8, temperature=0,
                                       extra_body={"structured_outputs": {"json_object": True}})
    assert r.choices[0].message.content.startswith("{")
    for sp in ({"ebnf": 'root ::= "yes" | "no"'}, {"regex": "yes|no"}, {"json_schema": json.dumps({"enum": ["yes"]})}):
        out = post(server, "/generate", {"text": "Answer:", "sampling_params": {
            "max_new_tokens": 10, "temperature": 1.0, **sp}}).json()
        assert out["text"].strip('"') in ("yes", "no"), (sp, out)


def test_stop_regex_stops_at_a_match(server: ServerProcess, client: openai.OpenAI) -> None:
    """SGLang's stop_regex: the output stops once it matches (the match stays, as SGLang); without it the same
    constrained output runs to max_tokens."""
    body = {"regex": "(ab)+", "min_tokens": 12}  # EOS banned: the grammar alone never ends
    free = client.completions.create(model="x", prompt="x", max_tokens=12, temperature=0, extra_body=body)
    assert free.choices[0].finish_reason == "length" and "ba" in free.choices[0].text
    for extra in ({"stop_regex": "b+a"}, {"stop_regex": ["zz", "b+a"]}):
        r = client.completions.create(model="x", prompt="x", max_tokens=12, temperature=0, extra_body={**body, **extra})
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and choice.model_extra["matched_stop"] == "b+a", choice
        assert re.search("b+a", choice.text) and r.usage.completion_tokens < 12
    native = post(server, "/generate", {"text": "x", "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "regex": "(ab)+", "min_new_tokens": 12, "stop_regex": "b+a"}}).json()
    assert native["meta_info"]["finish_reason"] == {"type": "stop", "matched": "b+a"}


@pytest.mark.parametrize(("path", "body", "param"), [
    (CHAT, {"guided_json": {"type": "nonsense"}}, "guided_json"),
    (CHAT, {"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs"),
    (CMPL, {"guided_regex": "(ab"}, "guided_regex"),
    (CMPL, {"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
    (CMPL, {"ebnf": "start: nope"}, "ebnf"),
    (CHAT, {"guided_grammar": "start: nope"}, "guided_grammar"),
    (CHAT, {"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs"),
    (CMPL, {"json_schema": "{not json"}, "json_schema"),
    (CMPL, {"guided_choice": []}, "guided_choice"),
    (CMPL, {"stop_regex": "(ab"}, "stop_regex"),
    (CHAT, {"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    (CHAT, {"guided_json": SCHEMA, "regex": "a"}, "guided_json"),
    (CMPL, {"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
    (CHAT, {"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "response_format"),
    ("/generate", {"sampling_params": {"ebnf": "start: nope"}}, "sampling_params.ebnf"),
    ("/generate", {"sampling_params": {"ebnf": 'start: "a"', "regex": "a"}}, "sampling_params.regex"),
])
def test_bad_or_several_constraints_are_400s_naming_the_field(server: ServerProcess, path: str, body: dict,
                                                               param: str) -> None:
    base = {CHAT: {"messages": MESSAGES}, CMPL: {"prompt": "hi"}, "/generate": {"text": "hi"}}[path]
    err = error(server, path, {**base, "max_tokens": 2, **body} if path != "/generate" else {**base, **body})
    assert err["param"] == param and param.split(".")[-1] in err["message"], err
    if len([k for k in body if k != "response_format"]) > 1 or "at most one" in err["message"]:
        assert "at most one" in err["message"]


# ---------------------------------------------------------------- 2. logprob formats
def test_completion_logprobs_always_include_the_sampled_token(client: openai.OpenAI) -> None:
    r = client.completions.create(model="x", prompt="Once upon", max_tokens=6, temperature=1.5, seed=7, logprobs=0)
    lp = r.choices[0].logprobs
    assert [list(t) for t in lp.top_logprobs] == [[tok] for tok in lp.tokens]  # the sampled token only
    assert [t[tok] for t, tok in zip(lp.top_logprobs, lp.tokens)] == lp.token_logprobs
    r = client.completions.create(model="x", prompt="Once upon", max_tokens=12, temperature=3.0, seed=1, logprobs=1)
    lp = r.choices[0].logprobs
    assert all(tok in t and 1 <= len(t) <= 2 for t, tok in zip(lp.top_logprobs, lp.tokens))
    assert any(len(t) == 2 for t in lp.top_logprobs)  # at temperature 3 some draws are not the top token


def check_vllm_prompt_logprobs(entries: list, prompt_ids: list[int], k: int) -> None:
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for tid, entry in zip(prompt_ids[1:], entries[1:]):
        assert str(tid) in entry and len(entry) <= k + 1
        assert all(set(v) == {"logprob", "rank", "decoded_token"} and v["logprob"] <= 0 for v in entry.values())
        ranks = sorted(v["rank"] for v in entry.values())  # the token's own rank too, in or out of the top k
        if len(entry) == k + 1:  # outside the top k: ranked after them
            assert ranks[:k] == list(range(1, k + 1)) and entry[str(tid)]["rank"] > k
        else:
            assert ranks == list(range(1, len(entry) + 1))


def test_prompt_logprobs_as_vllm(server: ServerProcess, client: openai.OpenAI) -> None:
    ids = post(server, "/v1/tokenize", {"prompt": "Hello there friend"}).json()["tokens"]
    r = client.completions.create(model="x", prompt=ids, max_tokens=2, extra_body={"prompt_logprobs": 2})
    check_vllm_prompt_logprobs(r.choices[0].model_extra["prompt_logprobs"], ids, 2)
    echo = client.completions.create(model="x", prompt=ids, max_tokens=1, echo=True, logprobs=1)
    expected = echo.choices[0].logprobs.token_logprobs[1:len(ids)]
    got = [e[str(t)]["logprob"] for t, e in zip(ids[1:], r.choices[0].model_extra["prompt_logprobs"][1:])]
    assert got == pytest.approx(expected, abs=1e-5)
    chat = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0, "return_token_ids": True})
    prompt_ids = chat.model_extra["prompt_token_ids"]
    check_vllm_prompt_logprobs(chat.model_extra["prompt_logprobs"], prompt_ids, 0)
    assert error(server, CMPL, {"prompt": "hi", "prompt_logprobs": -1})["param"] == "prompt_logprobs"
    assert error(server, CHAT, {"messages": MESSAGES, "prompt_logprobs": 1, "stream": True})["param"] == \
        "prompt_logprobs"


def test_native_generate_logprobs_in_sglang_shape(server: ServerProcess) -> None:
    ids = post(server, "/v1/tokenize", {"prompt": "Hello there my friend"}).json()["tokens"]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 1, "return_text_in_logprobs": True}
    meta = post(server, "/generate", body).json()["meta_info"]
    out, inp = meta["output_token_logprobs"], meta["input_token_logprobs"]
    assert len(out) == 3 and all(lp <= 0 and isinstance(t, int) and isinstance(s, str) for lp, t, s in out)
    assert [t for _, t, _ in inp] == ids[1:] and all(lp is not None for lp, _, _ in inp)
    assert [len(top) for top in meta["output_top_logprobs"]] == [2, 2, 2]
    assert meta["output_top_logprobs"][0][0][1] == out[0][1]  # greedy: the top alternative is the token
    assert len(meta["input_top_logprobs"]) == len(ids) - 1
    plain = post(server, "/generate", {**body, "return_text_in_logprobs": False, "logprob_start_len": 0}).json()
    first = plain["meta_info"]["input_token_logprobs"][0]
    assert first == [None, ids[0], None] and plain["meta_info"]["input_top_logprobs"][0] is None
    only_out = post(server, "/generate", {**body, "logprob_start_len": -1}).json()["meta_info"]
    assert only_out["input_token_logprobs"] == [] and len(only_out["output_token_logprobs"]) == 3
    assert error(server, "/generate", {**body, "logprob_start_len": len(ids)})["param"] == "logprob_start_len"
    assert error(server, "/generate", {**body, "top_logprobs_num": 21})["param"] == "top_logprobs_num"


# ---------------------------------------------------------------- 3. token ids
def test_token_ids_in_responses_and_logprobs(server: ServerProcess, client: openai.OpenAI) -> None:
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    r = client.completions.create(model="x", prompt="Hello there", max_tokens=4, temperature=0, logprobs=1,
                                  extra_body=extra)
    c = r.choices[0].model_extra
    assert c["prompt_token_ids"] == post(server, "/v1/tokenize", {"prompt": "Hello there"}).json()["tokens"]
    assert len(c["token_ids"]) == 4 and r.choices[0].logprobs.tokens == [f"token_id:{t}" for t in c["token_ids"]]
    chat = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=1, extra_body=extra)
    ids = chat.choices[0].model_extra["token_ids"]
    assert [t.token for t in chat.choices[0].logprobs.content] == [f"token_id:{t}" for t in ids]
    assert chat.choices[0].logprobs.content[0].top_logprobs[0].token.startswith("token_id:")
    events = sse_events(server, CHAT, {"messages": MESSAGES, "max_tokens": 4, "temperature": 0,
                                       "return_token_ids": True})
    assert events[0]["prompt_token_ids"] == chat.model_extra["prompt_token_ids"]
    assert [t for e in events for c in e["choices"] for t in c["token_ids"] or []] == ids
    assert all("prompt_token_ids" not in e or e["prompt_token_ids"] is None for e in events[1:])
    assert all(c["token_ids"] is None or c["token_ids"] for e in events for c in e["choices"])  # never []
    events = sse_events(server, CMPL, {"prompt": "Hello there", "max_tokens": 4, "temperature": 0,
                                       "return_token_ids": True})
    assert events[0]["choices"][0]["prompt_token_ids"] == c["prompt_token_ids"]
    assert [t for e in events for c in e["choices"] for t in c["token_ids"] or []] == c["token_ids"]


def test_truncate_prompt_tokens_keeps_the_last_ones(server: ServerProcess, client: openai.OpenAI) -> None:
    prompt = "one two three four five six seven eight nine ten"
    ids = post(server, "/v1/tokenize", {"prompt": prompt}).json()["tokens"]
    r = client.completions.create(model="x", prompt=prompt, max_tokens=1, echo=True,
                                  extra_body={"truncate_prompt_tokens": 3, "return_token_ids": True})
    assert r.usage.prompt_tokens == 3 and r.choices[0].model_extra["prompt_token_ids"] == ids[-3:]
    right = client.completions.create(model="x", prompt=prompt, max_tokens=1, echo=True,
                                      extra_body={"truncate_prompt_tokens": 3, "truncation_side": "right",
                                                  "return_token_ids": True})
    assert right.choices[0].model_extra["prompt_token_ids"] == ids[:3]
    assert error(server, CMPL, {"prompt": prompt, "truncate_prompt_tokens": 3, "truncation_side": "middle"})[
        "param"] == "truncation_side"
    chat = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    assert error(server, CMPL, {"prompt": prompt, "truncate_prompt_tokens": 0})["param"] == "truncate_prompt_tokens"
    assert error(server, CMPL, {"prompt": "a b", "truncate_prompt_tokens": -5})["param"] == "truncate_prompt_tokens"
    # -1: as many of the last tokens as leave room for one generated token, however long the prompt.
    long = client.completions.create(model="x", prompt="word " * 1500, max_tokens=1,
                                     extra_body={"truncate_prompt_tokens": -1})
    assert 256 < long.usage.prompt_tokens < 768 and long.usage.completion_tokens == 1


# ---------------------------------------------------------------- 4. streaming
def test_continuous_usage_stats(server: ServerProcess) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    for path, base in ((CHAT, {"messages": MESSAGES}), (CMPL, {"prompt": "Hello"})):
        events = sse_events(server, path, {**base, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                                           "stream_options": options})
        assert all(e["usage"] is not None for e in events), events
        counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
        assert counts == sorted(counts) and counts[-1] == 5 and events[-1]["usage"]["completion_tokens"] == 5
        if path == CHAT:  # the role chunk comes before any token
            assert events[0]["choices"][0]["delta"]["role"] == "assistant" and counts[0] == 0
        plain = sse_events(server, path, {**base, "max_tokens": 5, "stream_options": {"include_usage": True}})
        assert [e["usage"] is None for e in plain] == [True] * (len(plain) - 1) + [False]


def test_stream_options_without_stream_is_a_400(server: ServerProcess) -> None:
    for path, base in ((CHAT, {"messages": MESSAGES}), (CMPL, {"prompt": "Hello"})):
        err = error(server, path, {**base, "max_tokens": 2, "stream_options": {"include_usage": True}})
        assert err["param"] == "stream_options" and "stream" in err["message"]


def test_chat_deltas_carry_reasoning_content_null(server: ServerProcess) -> None:
    events = sse_events(server, CHAT, {"messages": MESSAGES, "max_tokens": 3})
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert deltas and all("reasoning_content" in d and d["reasoning_content"] is None for d in deltas)


def test_chat_echo_as_vllm(server: ServerProcess, client: openai.OpenAI) -> None:
    partial = [*MESSAGES, {"role": "assistant", "content": "My favourite is"}]
    kw = {"model": "x", "messages": partial, "max_tokens": 3, "temperature": 0}
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    plain = client.chat.completions.create(**kw, extra_body=extra).choices[0].message.content
    echoed = client.chat.completions.create(**kw, extra_body={**extra, "echo": True}).choices[0].message.content
    assert echoed == "My favourite is" + plain
    stream = client.chat.completions.create(**kw, stream=True, extra_body={**extra, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == echoed
    # The last message is the user's: nothing to echo into the assistant's reply.
    user_last = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=3, temperature=0,
                                               extra_body={"echo": True}).choices[0].message.content
    assert not user_last.startswith(MESSAGES[0]["content"])


# ---------------------------------------------------------------- 7. validation
def test_seed_range(server: ServerProcess, client: openai.OpenAI) -> None:
    assert client.completions.create(model="x", prompt="hi", max_tokens=1, seed=2**63 - 1).choices
    for path, base in ((CHAT, {"messages": MESSAGES}), (CMPL, {"prompt": "hi"})):  # pydantic's bounds, as vLLM
        for seed, check in ((2**63, "less_than_equal"), (-(2**63) - 1, "greater_than_equal")):
            err = error(server, path, {**base, "seed": seed})
            assert err["param"] == "seed" and check in err["message"], err
    err = error(server, "/generate", {"text": "hi", "sampling_params": {"seed": 2**63}})  # SGLang's native API
    assert err["param"].endswith("seed") and "2^63" in err["message"], err


def test_top_logprobs_minus_one_is_one_400(server: ServerProcess) -> None:
    errs = [error(server, CHAT, {"messages": MESSAGES, "top_logprobs": -1, **extra})
            for extra in ({}, {"logprobs": True}, {"logprobs": False})]
    assert all(e == errs[0] for e in errs) and errs[0]["param"] == "top_logprobs"
    assert errs[0]["message"] == ("top_logprobs -1 (the whole vocabulary) needs the server started with "
                                  "--max-logprobs -1; this one allows at most 20")
    assert error(server, CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21})["message"] == \
        "top_logprobs must be in [0, 20], got 21"


def test_every_bad_logit_bias_key_is_named(server: ServerProcess) -> None:
    err = error(server, CMPL, {"prompt": "hi", "logit_bias": {"5": 1, "abc": 1, "99999999": 2, "-3": 1}})
    assert err["param"] == "logit_bias"
    assert all(k in err["message"] for k in ("'abc'", "99999999", "-3")) and "5," not in err["message"]


def test_models_hide_the_path_and_report_the_context_length(server: ServerProcess, tiny_llama) -> None:
    model_dir, _ = tiny_llama
    for r in (httpx.get(f"{server.base_url}/v1/models").json()["data"][0], ):
        card = httpx.get(f"{server.base_url}/v1/models/{r['id']}").json()
        for c in (r, card):
            assert str(model_dir) not in json.dumps(c) and c["root"] == c["id"]
            assert c["max_model_len"] == 768  # --context-length, though the KV pool holds only 512 tokens
    assert httpx.get(f"{server.base_url}/server_info").json()["context_length"] == 768


def test_a_prompt_longer_than_the_kv_pool_names_both_sizes(server: ServerProcess) -> None:
    """--context-length 768 over a KV pool of 512 tokens: a 600-token prompt fits the one, not the other."""
    err = error(server, CMPL, {"prompt": [5] * 600, "max_tokens": 2})
    assert err["param"] == "prompt"
    assert "The input (600 tokens) is longer than the model's context length (512 tokens)" in err["message"]
    assert "The KV cache pool holds 512 tokens, fewer than the model's context length of 768" in err["message"]
    assert post(server, CMPL, {"prompt": "hi", "max_tokens": 2}).status_code == 200  # still serving


# ---------------------------------------------------------------- 8. beam search
def test_beam_search_is_refused_not_ignored(server: ServerProcess) -> None:
    for path, base in ((CHAT, {"messages": MESSAGES}), (CMPL, {"prompt": "hi"})):
        err = error(server, path, {**base, "max_tokens": 2, "use_beam_search": True})
        assert err["param"] == "use_beam_search" and "not supported" in err["message"]
    err = error(server, CMPL, {"prompt": "hi", "max_tokens": 2, "best_of": 3, "n": 1})
    assert err["param"] == "best_of" and "not supported" in err["message"]
    assert post(server, CMPL, {"prompt": "hi", "max_tokens": 2, "use_beam_search": False, "best_of": 1}).status_code \
        == 200


def test_return_tokens_as_token_ids_and_max_logprobs_flags(tiny_llama: tuple[Path, object], tmp_path: Path) -> None:
    """vLLM's --return-tokens-as-token-ids (every logprob names its token as token_id:N without the request
    asking) and --max-logprobs -1 (-1 in a request: the whole vocabulary)."""
    srv = start_server(["--model-path", str(tiny_llama[0]), "--disable-torch-compile", "--max-total-tokens", "1024",
                        "--served-model-name", "x", "--return-tokens-as-token-ids", "--max-logprobs", "-1"],
                       tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        chat = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=3, logprobs=True,
                                              top_logprobs=1)
        assert all(re.fullmatch(r"token_id:\d+", t.token) for t in chat.choices[0].logprobs.content)
        cmpl = client.completions.create(model="x", prompt="Hello", max_tokens=3, logprobs=1)
        assert all(re.fullmatch(r"token_id:\d+", t) for t in cmpl.choices[0].logprobs.tokens)
        vocab = httpx.get(f"{srv.base_url}/model_info", timeout=30).json()["vocab_size"]
        whole = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=1, logprobs=True,
                                               top_logprobs=-1)
        assert len(whole.choices[0].logprobs.content[0].top_logprobs) == vocab
        ids = httpx.post(f"{srv.base_url}/v1/tokenize", json={"prompt": "Hi there"}, timeout=30).json()["tokens"]
        scored = client.completions.create(model="x", prompt=ids, max_tokens=1, logprobs=-1,
                                           extra_body={"prompt_logprobs": -1})
        assert len(scored.choices[0].logprobs.top_logprobs[0]) >= vocab  # the chosen token among them
        assert all(len(e) == vocab for e in scored.choices[0].model_extra["prompt_logprobs"][1:])
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
