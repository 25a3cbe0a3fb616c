"""gpt-oss's harmony format: `--tool-call-parser openai` and `--reasoning-parser openai_gptoss`, read with the
openai-harmony package.

First the parsers on the exact text gpt-oss writes (by hand, from OpenAI's harmony documentation), whole and
streamed with the output cut everywhere a model can cut it (any character outside a special token) and token by
token; then where the o200k vocabulary comes from offline; then a real server over HTTP with the `openai`
client, on a model built in code whose weights make its greedy output a harmony reply: an analysis message, a
final message and a call of get_weather.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import transformers

from servelm.config import ServerArgs
from servelm.entrypoints import harmony, reasoning
from servelm.entrypoints.openai_protocol import ChatTool
from servelm.entrypoints.reasoning import auto_format
from servelm.entrypoints.tool_calls import plan_tool_calls
from servelm.entrypoints.tool_parsers import make_parser, pick_parser
from servelm.kernels import build as kernel_build
from tests.conftest import build_bigram_chain_model
from tests.entrypoints.test_tool_parsers import _stream as stream_pieces
from tests.server_fixtures import ServerProcess, sse_events, start_server

pytest.importorskip("openai_harmony")
if harmony.vocab_from_quicktok() is None:  # the test extra installs it
    pytest.skip("quicktok-v1 (the o200k vocabulary for openai-harmony, offline) is not installed",
                allow_module_level=True)

GPT_OSS = reasoning.BUILTIN["openai_gptoss"]
TOOLS = [ChatTool.model_validate({"type": "function", "function": {"name": n, "parameters": {"type": "object"}}})
         for n in ("get_weather", "get_time")]
SF = {"location": "San Francisco"}

# (model output after the prompt's `<|start|>assistant`, reasoning, content, [(name, arguments)])
GOLDEN = [
    # a plain answer (the <|return|> stop token is not in the text; with it, the same)
    ('<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.<|end|>'
     '<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.',
     'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "2 + 2 = 4.", []),
    ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Yes.<|return|>",
     "Easy.", "Yes.", []),
    # a function call, recipient in the channel header, <|constrain|>json
    ('<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant<|channel|>commentary '
     'to=functions.get_weather <|constrain|>json<|message|>{"location":"San Francisco"}<|call|>',
     "Need to use function get_weather.", None, [("get_weather", SF)]),
    # the recipient in the role header; the <|call|> stop token left out
    ('<|channel|>analysis<|message|>Weather.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary '
     'json<|message|>{"location": "San Francisco"}', "Weather.", None, [("get_weather", SF)]),
    # a preamble the user sees, then two calls (one without arguments)
    ("<|channel|>analysis<|message|>Two lookups.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking "
     "the weather and the time.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
     '<|constrain|>json<|message|>{"location":"San Francisco"}<|call|><|start|>assistant<|channel|>commentary '
     "to=functions.get_time <|constrain|>json<|message|>{}<|call|>",
     "Two lookups.", "Checking the weather and the time.", [("get_weather", SF), ("get_time", {})]),
    # two analysis messages around a built-in tool's call (browser: not a function; dropped)
    ("<|channel|>analysis<|message|>Search first.<|end|><|start|>assistant<|channel|>analysis to=browser.search "
     'code<|message|>{"query": "weather"}<|call|><|start|>assistant<|channel|>analysis<|message|>Found it.<|end|>'
     "<|start|>assistant<|channel|>final<|message|>Sunny.",
     "Search first.\n\nFound it.", "Sunny.", []),
    # cut off while thinking, and in a header after the thinking
    ("<|channel|>analysis<|message|>Still thinking about", "Still thinking about", None, []),
    ("<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|channel|>fin", "Done.", None, []),
    # not harmony at all: content as written
    ("Hello, plain text.", "", "Hello, plain text.", []),
    ("<|channel|>final<|message|>Bonjour, ça va ? 🌤", "", "Bonjour, ça va ? 🌤", []),
]
SPECIAL = re.compile(r"<\|[a-z_]+\|>")


def _calls(calls: list) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def _cuts(text: str) -> list[list[str]]:
    """The text in two pieces at every place outside a special token (a model writes those whole); in runs
    between special tokens; one piece per character (special tokens whole); one piece per o200k token."""
    inside = {i for m in SPECIAL.finditer(text) for i in range(m.start() + 1, m.end())}
    out = [[text[:c], text[c:]] for c in range(len(text) + 1) if c not in inside]
    runs = [p for p in re.split(f"({SPECIAL.pattern})", text) if p]
    out.append(runs)
    out.append([c for p in runs for c in ([p] if SPECIAL.fullmatch(p) else p)])
    if text.isascii():  # (a token of a longer character decodes alone to U+FFFD)
        enc = harmony.encoding()
        out.append([enc.decode([t]) for t in enc.encode(text, allowed_special="all")])
    return out


@pytest.mark.parametrize("text, want_reasoning, content, calls", GOLDEN)
def test_tool_parser_whole_and_at_every_cut(text: str, want_reasoning: str, content: str | None, calls: list) -> None:
    got_content, got_calls = make_parser("openai", TOOLS).parse(text)
    assert got_content == content and _calls(got_calls) == calls
    plan = plan_tool_calls(TOOLS, "auto", make_parser("openai", TOOLS))
    assert plan is not None and _calls(plan.read(text)[1]) == calls
    for pieces in _cuts(text):
        streamed, names, args, late = stream_pieces("openai", pieces)  # checks id and name come first
        assert streamed.strip() == (content or ""), pieces
        assert [(names[k], json.loads(args[k])) for k in sorted(names)] + _calls(late) == calls, pieces


@pytest.mark.parametrize("text, want_reasoning, content, calls", GOLDEN)
def test_reasoning_split_whole_and_at_every_cut(text: str, want_reasoning: str, content: str | None,
                                                calls: list) -> None:
    for pieces in [[text], *_cuts(text)]:
        split = harmony.HarmonyReasoningStream(GPT_OSS)
        thought, answer = "", ""
        for piece in pieces:
            r, a = split.feed(piece)
            thought, answer = thought + r, answer + a
        r, a = split.finish()
        assert (thought + r, answer + a) == (want_reasoning, content or ""), pieces
        assert (split.reasoning_text, split.answer_text) == (want_reasoning, content or "")
        # with the openai tool parser next, the answer is the output as written, for it to read
        markup = harmony.HarmonyReasoningStream(GPT_OSS, markup=True)
        assert "".join(markup.feed(p)[1] for p in pieces) + markup.finish()[1] == text


def test_reasoning_tokens_count_the_analysis_messages() -> None:
    enc = harmony.encoding()
    analysis = "<|channel|>analysis<|message|>Let me think about it.<|end|>"
    text = analysis + "<|start|>assistant<|channel|>final<|message|>Four."
    split = harmony.HarmonyReasoningStream(GPT_OSS)
    split.feed(text)
    split.finish()
    ids = enc.encode(text, allowed_special="all")
    assert split.reasoning_tokens(ids, None) == len(enc.encode(analysis, allowed_special="all"))
    cut = harmony.HarmonyReasoningStream(GPT_OSS)  # cut off while thinking: all of it
    cut.feed("<|channel|>analysis<|message|>Hmm, let")
    cut.finish()
    assert cut.reasoning_tokens([1] * 7, None) == 7


def test_auto_reads_a_gpt_oss_template_and_flags_accept_the_names() -> None:
    assert pick_parser(TEMPLATE) == "openai" and auto_format(TEMPLATE) is GPT_OSS
    assert reasoning.resolve("gpt-oss", None).harmony and reasoning.resolve("openai_gptoss", None) is GPT_OSS
    args = ServerArgs(model_path="m", tool_call_parser="openai", reasoning_parser="openai_gptoss")
    assert (args.tool_call_parser, args.reasoning_parser) == ("openai", "openai_gptoss")


# ------------------------------------------------------------------------------------ the vocabulary offline
def test_vocab_from_quicktok_and_from_a_byte_level_tokenizer(tmp_path: Path) -> None:
    """The file harmony checks by SHA-256, written from quicktok-v1's table and from a byte-level BPE
    tokenizer's vocabulary (a gpt-oss tokenizer.json's); another tokenizer's is refused."""
    import tokenizers

    table = harmony.vocab_from_quicktok()
    assert table is not None and harmony._write(list(table), tmp_path / "a" / harmony.VOCAB_FILE)
    assert harmony._valid(tmp_path / "a" / harmony.VOCAB_FILE)
    to_char = {b: c for c, b in harmony._byte_decoder().items()}
    vocab = {"".join(to_char[b] for b in token): rank for rank, token in table}
    vocab["<|endoftext|>"] = 199999
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    assert harmony._write(harmony.vocab_from_tokenizer(tok), tmp_path / "b" / harmony.VOCAB_FILE)
    small = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    assert harmony.vocab_from_tokenizer(small) is None
    swapped = dict(vocab, **{"Ġthe": vocab["Ġand"], "Ġand": vocab["Ġthe"]})
    assert not harmony._write(harmony.vocab_from_tokenizer(
        tokenizers.Tokenizer(tokenizers.models.BPE(vocab=swapped, merges=[]))), tmp_path / "c" / harmony.VOCAB_FILE)


def test_vocab_dir_writes_the_cache_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = harmony.vocab_dir(None)
    assert folder == str(tmp_path / "servelm" / "tiktoken") and harmony._valid(Path(folder) / harmony.VOCAB_FILE)
    monkeypatch.setattr(harmony, "vocab_from_quicktok", lambda: pytest.fail("read again"))
    assert harmony.vocab_dir(None) == folder
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", "/somewhere")
    assert harmony.vocab_dir(None) == "/somewhere"


# ------------------------------------------------------------------------------------ a server on a harmony model
# A gpt-oss-shaped chat template (its markers are what `auto` reads): system/user turns, the assistant's past
# thinking as analysis, its calls as messages to functions.NAME, tool results from the function.
TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "{%- if m.reasoning_content %}{{ '<|start|>assistant<|channel|>analysis<|message|>' + m.reasoning_content"
    " + '<|end|>' }}{%- endif %}"
    "{%- for c in m.tool_calls %}{{ '<|start|>assistant<|channel|>commentary to=functions.' + c.function.name"
    " + ' <|constrain|>json<|message|>' + (c.function.arguments | tojson) + '<|call|>' }}{%- endfor %}"
    "{%- elif m.role == 'tool' %}{{ '<|start|>functions.' + (m.name or 'tool') + ' to=assistant<|channel|>"
    "commentary<|message|>' + m.content + '<|end|>' }}"
    "{%- else %}{{ '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|start|>assistant' }}{%- endif %}")
SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"]
# The scripted reply. A bigram chain needs distinct tokens, so the later messages' headers are each one added
# token whose text is the whole header: the text servelm detokenizes is exactly what gpt-oss writes.
FINAL_HEADER = "<|end|><|start|>assistant<|channel|>final<|message|>"
CALL_HEADER = "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
THOUGHT, ANSWER, ARGS = "Let me think", "The answer", '{"city": "Paris"}'


def _chain(tok: transformers.PreTrainedTokenizerBase) -> list[int]:
    """The token ids of the reply after the generation prompt's last token, EOS last."""
    def enc(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False)

    ids = (enc("assistant")[-1:] + enc("<|channel|>") + enc("analysis") + enc("<|message|>") + enc(THOUGHT)
           + [tok.convert_tokens_to_ids(FINAL_HEADER)] + enc(ANSWER) + [tok.convert_tokens_to_ids(CALL_HEADER)]
           + enc(ARGS) + [tok.eos_token_id])
    return ids


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory: pytest.TempPathFactory, default_tokenizer_dir: Path) -> Path:
    tok_dir = tmp_path_factory.mktemp("harmony_tokenizer")
    tok = transformers.AutoTokenizer.from_pretrained(default_tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.add_tokens([FINAL_HEADER, CALL_HEADER])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(tok_dir)
    out, got = build_bigram_chain_model(tmp_path_factory.mktemp("harmony_model"), tok_dir, _chain(tok), MESSAGES)
    assert tok.decode(got[:-1], skip_special_tokens=False) == (
        f"<|channel|>analysis<|message|>{THOUGHT}{FINAL_HEADER}{ANSWER}{CALL_HEADER}{ARGS}")
    return out


@pytest.fixture(scope="module")
def server(harmony_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Both parsers from the chat template (auto); the vocabulary written into a fresh cache from quicktok-v1."""
    tmp = tmp_path_factory.mktemp("harmony_server")
    # a fresh XDG cache for the vocabulary, the built kernels' cache kept (else the server rebuilds them: ~85 s)
    env = {"XDG_CACHE_HOME": str(tmp / "cache"), "TIKTOKEN_ENCODINGS_BASE": "",
           kernel_build.CACHE_ENV: str(kernel_build.cache_root())}
    srv = start_server(["--model-path", str(harmony_model), "--disable-torch-compile", "--max-total-tokens", "4096",
                        "--served-model-name", "oss", "--reasoning-parser", "auto", "--tool-call-parser", "auto"],
                       tmp / "server.log", env)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60,
                         _strict_response_validation=True)


MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.slow  # starts a server
@pytest.mark.parametrize("stream", [False, True])
def test_server_reasoning_answer_and_tool_call(server: ServerProcess, client: openai.OpenAI, stream: bool) -> None:
    kw = {"model": "oss", "messages": MESSAGES, "temperature": 0, "max_tokens": 40, "tools": WEATHER}
    if not stream:
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        assert (msg.reasoning_content, msg.content) == (THOUGHT, ANSWER)  # type: ignore[attr-defined]
        assert _calls(msg.tool_calls) == [("get_weather", {"city": "Paris"})]
        assert r.choices[0].finish_reason == "tool_calls"
        assert 0 < r.usage.completion_tokens_details.reasoning_tokens < r.usage.completion_tokens
    else:
        thought, content, args, names = "", "", "", []
        for chunk in client.chat.completions.create(**kw, stream=True):
            for c in chunk.choices:
                thought += getattr(c.delta, "reasoning_content", None) or ""
                content += c.delta.content or ""
                for d in c.delta.tool_calls or []:
                    names += [d.function.name] if d.function.name else []
                    args += d.function.arguments or ""
        assert (thought, content, names, json.loads(args)) == (THOUGHT, ANSWER, ["get_weather"], {"city": "Paris"})
    log = server.log()
    assert "reasoning parser: openai_gptoss" in log and "tool-call parser: openai" in log
    assert "harmony: wrote the o200k_base vocabulary from quicktok-v1" in log


@pytest.mark.slow  # starts a server
def test_server_without_tools_and_through_responses(server: ServerProcess, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="oss", messages=MESSAGES, temperature=0, max_tokens=40)
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content, msg.tool_calls) == (THOUGHT, ANSWER, None)  # type: ignore[attr-defined]
    resp = client.responses.create(model="oss", input="Weather in Paris?", temperature=0, max_output_tokens=40,
                                   tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER[0][
                                       "function"]["parameters"]}])
    kinds = [item.type for item in resp.output]
    assert kinds == ["reasoning", "message", "function_call"], kinds
    assert resp.output[0].content[0].text == THOUGHT and resp.output[2].name == "get_weather"
    events = sse_events(server, "/v1/responses", {"model": "oss", "input": "Weather in Paris?", "temperature": 0,
                                                  "max_output_tokens": 40})
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == THOUGHT
    # a forced call cannot be placed in harmony's header yet: a 400 that says so, and the server serves on
    with pytest.raises(openai.BadRequestError, match="not supported with --reasoning-parser openai_gptoss"):
        client.chat.completions.create(model="oss", messages=MESSAGES, max_tokens=8, tools=WEATHER,
                                       tool_choice="required")
    assert client.chat.completions.create(model="oss", messages=MESSAGES, max_tokens=4).choices


def test_start_up_loads_harmony_only_when_a_parser_uses_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without its vocabulary a harmony server stops at start-up with one line saying what to do."""
    from servelm.entrypoints.launch import _load_harmony_if_used

    monkeypatch.setattr(harmony, "_ENCODING", None)
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path))  # no o200k_base.tiktoken there
    import tokenizers

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.BPE(vocab={"a": 0}, merges=[])))
    tok.chat_template = TEMPLATE
    _load_harmony_if_used(ServerArgs(model_path="m", tool_call_parser="hermes", reasoning_parser="qwen3"), tok)
    for args in (ServerArgs(model_path="m", tool_call_parser="auto"),
                 ServerArgs(model_path="m", reasoning_parser="gpt-oss")):
        with pytest.raises(harmony.HarmonyUnavailable, match="set TIKTOKEN_ENCODINGS_BASE to a folder with "
                                                             "o200k_base.tiktoken or pip install quicktok-v1"):
            _load_harmony_if_used(args, tok)
