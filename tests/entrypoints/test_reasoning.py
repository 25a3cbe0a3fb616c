"""--reasoning-parser: the splitter on golden texts cut at every place, then a real server on a Qwen3-shaped
model that thinks, driven by the `openai` client (chat, streams, tools and structured output after the
thinking, enable_thinking off, /v1/responses).

The model is a real Qwen3 checkpoint built in code whose weights make it a bigram chain: with o_proj and
down_proj zero every layer adds nothing to the residual stream, so the logits depend on the current token
alone, and lm_head row y is aimed at token x's normalised embedding for each link x -> y. So its greedy
output is exactly `<think>Let me think</think>\\n\\nThe answer` (then EOS) after the generation prompt, and
`The answer` after a prompt that closes an empty block (enable_thinking false), run through servelm's own
model code, sampler and detokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import transformers

from servelm import plugins
from servelm.config import ConfigError, ServerArgs
from servelm.entrypoints import reasoning
from servelm.entrypoints.reasoning import BUILTIN, ReasoningFormat, ReasoningStream, auto_format, resolve, split
from tests.conftest import build_bigram_chain_model
from tests.server_fixtures import ServerProcess, sse_events, start_server

QWEN3, R1 = BUILTIN["qwen3"], BUILTIN["deepseek_r1"]

# (format, output, prompt tail, reasoning, answer)
GOLDEN = [
    (QWEN3, "<think>\nLet me think.\n</think>\n\nThe answer is 4.", "", "Let me think.", "The answer is 4."),
    (QWEN3, "Hello there", "", "", "Hello there"),
    (QWEN3, " lead space", "", "", " lead space"),
    (QWEN3, "  <think>a</think>b", "", "a", "b"),
    (QWEN3, "answer only", "<think>\n\n</think>\n\n", "", "answer only"),  # enable_thinking false
    (QWEN3, "thinking</think> ans", "<|im_start|>assistant\n<think>\n", "thinking", "ans"),  # Thinking-2507
    (QWEN3, "<thi", "", "", "<thi"),
    (QWEN3, "<think>cut off </th", "", "cut off </th", ""),
    (QWEN3, "<think>a </b> < /think></think>", "", "a </b> < /think>", ""),
    (QWEN3, "<think>x</think>y</think>z", "", "x", "y</think>z"),
    (R1, "I reason</think>\n\nAnswer", "", "I reason", "Answer"),
    (R1, "<think>\nI reason</think>Answer", "", "I reason", "Answer"),  # R1-0528 writes <think> again
    (R1, "still thinking", "", "still thinking", ""),
    (R1, "</think>direct", "", "", "direct"),
]


@pytest.mark.parametrize("fmt, text, prompt, want_reasoning, want_answer", GOLDEN)
def test_golden_splits_at_every_two_cuts(fmt: ReasoningFormat, text: str, prompt: str, want_reasoning: str,
                                         want_answer: str) -> None:
    assert split(fmt, text, prompt) == (want_reasoning, want_answer)
    for a in range(len(text) + 1):
        for b in range(a, len(text) + 1):
            stream = ReasoningStream(fmt, prompt)
            pieces = [stream.feed(text[:a]), stream.feed(text[a:b]), stream.feed(text[b:]), stream.finish()]
            got = ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces))
            assert got == (want_reasoning, want_answer), (a, b)
            assert (stream.reasoning_text, stream.answer_text) == got


def test_nothing_is_held_back_that_cannot_start_a_marker() -> None:
    stream = ReasoningStream(QWEN3)
    assert stream.feed("<think>Let me") == ("Let me", "")
    assert stream.feed(" see </") == (" see", "")  # the space waits: it may precede </think>
    assert stream.feed("b>") == (" </b>", "")
    assert stream.feed("</think>\n\nOK") == ("", "OK")
    assert stream.finish() == ("", "")


def test_auto_reads_the_chat_template_and_unknown_names_are_refused() -> None:
    assert auto_format("{{ '<think>' }}{% if enable_thinking %}{% endif %}{{ '</think>' }}") is QWEN3
    assert auto_format("<｜Assistant｜><think>\n ... </think>") is R1
    assert auto_format("{{ messages }}") is None and auto_format(None) is None
    assert resolve(None, "<think></think>") is None and resolve("deepseek_r1", None) is R1
    with pytest.raises(ValueError, match="choose one of: auto, qwen3, deepseek_r1"):
        resolve("nope", None)
    with pytest.raises(ConfigError, match="--reasoning-parser 'nope' is not known"):
        ServerArgs(model_path="m", reasoning_parser="nope")


def test_a_plugin_adds_a_format_by_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    class EntryPoint:
        def __init__(self, name: str, obj: object) -> None:
            self.name, self.value, self._obj = name, f"plugin:{name}", obj

        def load(self) -> object:
            if isinstance(self._obj, Exception):
                raise self._obj
            return self._obj

    kimi = ReasoningFormat("kimi", start="◁think▷", end="◁/think▷")
    eps = [EntryPoint("kimi", kimi), EntryPoint("qwen3", kimi), EntryPoint("broken", ImportError("no module")),
           EntryPoint("made", lambda: ReasoningFormat("made", start="[T]", end="[/T]"))]
    monkeypatch.setattr(plugins.importlib.metadata, "entry_points", lambda group: eps)
    known = reasoning.formats()
    assert known["kimi"] is kimi and known["qwen3"] is QWEN3 and "broken" not in known  # built-ins win
    assert split(known["made"], "[T]hm[/T]ok") == ("hm", "ok")
    assert split(resolve("kimi", None), "◁think▷x◁/think▷y") == ("x", "y")


# ----------------------------------------------------------------------------------- the model that thinks
TEMPLATE = ("{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
            "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
            "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
            "{%- endif %}{%- endif %}")
THOUGHT, ANSWER = "Let me think", "The answer"


def _chain(tok: transformers.PreTrainedTokenizerBase) -> list[int]:
    """The token ids of the scripted output after the generation prompt's last token, EOS last."""
    ids = (tok.encode("\n", add_special_tokens=False) + tok.encode("<think>", add_special_tokens=False)
           + tok.encode(THOUGHT, add_special_tokens=False) + tok.encode("</think>", add_special_tokens=False)
           + tok.encode("\n\n", add_special_tokens=False) + tok.encode(ANSWER, add_special_tokens=False)
           + [tok.eos_token_id])
    return ids


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory, default_tokenizer_dir: Path) -> tuple[Path, int]:
    """The model's folder and how many of its output tokens are thinking (`<think>` to `</think>`)."""
    tok_dir = tmp_path_factory.mktemp("thinking_tokenizer")
    tok = transformers.AutoTokenizer.from_pretrained(default_tokenizer_dir)
    tok.add_tokens(["<think>", "</think>"])  # as Qwen3's: added tokens, not special ones
    tok.chat_template = TEMPLATE
    tok.save_pretrained(tok_dir)
    chain = _chain(tok)
    out, _ = build_bigram_chain_model(tmp_path_factory.mktemp("thinking_qwen3"), tok_dir, chain,
                                      [{"role": "user", "content": "2+2?"}])
    return out, chain.index(tok.convert_tokens_to_ids("</think>"))


@pytest.fixture(scope="module")
def server(thinking_model: tuple[Path, int], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("reasoning_server") / "server.log"
    srv = start_server(["--model-path", str(thinking_model[0]), "--disable-torch-compile", "--max-total-tokens", "4096",
                        "--served-model-name", "thinker", "--reasoning-parser", "auto", "--tool-call-parser",
                        "hermes"], log)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60,
                         _strict_response_validation=True)


MESSAGES = [{"role": "user", "content": "2+2?"}]
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}


def _chat(client: openai.OpenAI, **kw: object) -> object:
    return client.chat.completions.create(model="thinker", messages=MESSAGES, temperature=0,
                                          **{"max_tokens": 16, **kw})


@pytest.mark.slow  # starts a server
def test_reasoning_content_answer_and_reasoning_tokens(server: ServerProcess, client: openai.OpenAI,
                                                        thinking_model: tuple[Path, int]) -> None:
    r = _chat(client)
    msg = r.choices[0].message
    assert msg.content == ANSWER and msg.reasoning_content == THOUGHT and msg.reasoning == THOUGHT  # type: ignore[attr-defined]
    assert r.choices[0].finish_reason == "stop"
    # <think>, the thought's tokens and </think>
    assert r.usage.completion_tokens_details.reasoning_tokens == thinking_model[1]
    assert "reasoning parser: qwen3" in server.log()


@pytest.mark.slow  # starts a server
def test_stream_gives_the_same_split(client: openai.OpenAI) -> None:
    thought, answer, usage = "", "", None
    for chunk in _chat(client, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            thought += getattr(c.delta, "reasoning_content", None) or ""
            answer += c.delta.content or ""
    assert (thought, answer) == (THOUGHT, ANSWER)
    assert usage is not None and usage.completion_tokens_details.reasoning_tokens > 0


@pytest.mark.slow  # starts a server
def test_enable_thinking_false_is_all_answer(client: openai.OpenAI) -> None:
    r = _chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == ANSWER and r.choices[0].message.reasoning_content is None  # type: ignore[attr-defined]
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.slow  # starts a server
def test_cut_off_while_thinking(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="thinker", messages=MESSAGES, temperature=0, max_tokens=2)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length" and msg.content is None
    assert THOUGHT.startswith(msg.reasoning_content) and msg.reasoning_content  # type: ignore[attr-defined]
    assert r.usage.completion_tokens_details.reasoning_tokens == 2


@pytest.mark.slow  # starts a server
@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_call_follows_the_thinking(client: openai.OpenAI, stream: bool) -> None:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": CITY}}]
    choice = {"type": "function", "function": {"name": "weather"}}
    if not stream:
        r = _chat(client, tools=tools, tool_choice=choice, max_tokens=24)
        msg = r.choices[0].message
        thought, args = msg.reasoning_content, msg.tool_calls[0].function.arguments  # type: ignore[attr-defined]
    else:
        thought, args = "", ""
        for chunk in _chat(client, tools=tools, tool_choice=choice, max_tokens=24, stream=True):
            for c in chunk.choices:
                thought += getattr(c.delta, "reasoning_content", None) or ""
                args += "".join(t.function.arguments or "" for t in c.delta.tool_calls or [])
    assert thought == THOUGHT
    assert json.loads(args)["city"] in ("Paris", "Rome")


@pytest.mark.slow  # starts a server
def test_structured_output_applies_to_the_answer(client: openai.OpenAI) -> None:
    r = _chat(client, max_tokens=24,
              response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}})
    msg = r.choices[0].message
    assert msg.reasoning_content == THOUGHT  # type: ignore[attr-defined]
    assert json.loads(msg.content)["city"] in ("Paris", "Rome")
    # without thinking the constraint holds from the first token
    r = _chat(client, max_tokens=24, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
              response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}})
    assert r.choices[0].message.reasoning_content is None and json.loads(r.choices[0].message.content)  # type: ignore[attr-defined]


@pytest.mark.slow  # starts a server
def test_auto_tools_read_the_answer_only(client: openai.OpenAI) -> None:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": CITY}}]
    r = _chat(client, tools=tools)
    msg = r.choices[0].message
    assert msg.content == ANSWER and msg.reasoning_content == THOUGHT and not msg.tool_calls  # type: ignore[attr-defined]


@pytest.mark.slow  # starts a server
def test_responses_api_returns_a_reasoning_item(server: ServerProcess, client: openai.OpenAI) -> None:
    r = client.responses.create(model="thinker", input="2+2?", temperature=0, max_output_tokens=16)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == THOUGHT and r.output_text == ANSWER
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    events = sse_events(server, "/v1/responses", {"model": "thinker", "input": "2+2?", "temperature": 0,
                                                  "max_output_tokens": 16})
    kinds = [e["type"] for e in events]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == THOUGHT
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == ANSWER
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message"] and kinds[-1] == "response.completed"
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]


@pytest.mark.slow  # starts a server
def test_a_streamed_response_cut_off_while_thinking(server: ServerProcess) -> None:
    events = sse_events(server, "/v1/responses", {"model": "thinker", "input": "2+2?", "temperature": 0,
                                                  "max_output_tokens": 2})
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "response.incomplete", kinds
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thought and THOUGHT.startswith(thought)
    done = [e for e in events if e["type"] == "response.reasoning_text.done"]
    assert len(done) == 1 and done[0]["text"] == thought and done[0]["output_index"] == 0
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["reasoning", "message"]
