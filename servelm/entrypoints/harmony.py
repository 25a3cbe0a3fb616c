"""OpenAI's harmony format (gpt-oss), read with the `openai-harmony` package: the reasoning parser
`openai_gptoss` (SGLang's `gpt-oss`) and the tool-call parser `openai`, vLLM's names.

A gpt-oss reply is a run of messages after the prompt's `<|start|>assistant`:

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Rome"}
    <|call|>   (the call's result comes back in the next prompt)
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

* `analysis` messages are the thinking: `reasoning_content` with the reasoning parser (never content);
* `final` messages, and `commentary` ones without a recipient (the preambles the model shows the user), are
  the content;
* a message to `functions.NAME` is a call of NAME with the message as its JSON arguments (with the tool
  parser); messages to other recipients (the built-in `browser` and `python` tools) are dropped.

The output's text (special tokens kept) is encoded with harmony's own o200k encoding and fed token by token to
its `StreamableParser`, so a streamed reply and a whole one are read by the same machine; text the parser cannot
read (a model that does not write harmony) is content.

The encoding needs the o200k_base vocabulary, which `openai-harmony` downloads on first use. Offline, servelm
finds it (`vocab_dir`): `TIKTOKEN_ENCODINGS_BASE` when set, servelm's cache, or else it writes the file into the
cache from the served model's own tokenizer (a gpt-oss tokenizer holds all of o200k) or from the `quicktok-v1`
package's copy. harmony checks the file's SHA-256, so a wrong vocabulary is an error, never a wrong parse.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import logging
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

VOCAB_FILE = "o200k_base.tiktoken"
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # tiktoken's own check
VOCAB_SIZE = 199_998  # o200k's ordinary (non-special) tokens
FUNCTIONS = "functions."


class HarmonyUnavailable(RuntimeError):
    """openai-harmony or its vocabulary is missing (the message says what to install or set)."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "servelm" / "tiktoken"


def _valid(path: Path) -> bool:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest() == VOCAB_SHA256
    except OSError:
        return False


def _write(ranked: list[tuple[int, bytes]], where: Path) -> bool:
    """Write `ranked` (rank, bytes) as a .tiktoken file at `where` when it is o200k_base exactly."""
    ranked.sort()
    if len(ranked) != VOCAB_SIZE or any(r != i for i, (r, _) in enumerate(ranked)):
        return False
    data = b"".join(base64.b64encode(b) + b" " + str(r).encode() + b"\n" for r, b in ranked)
    if hashlib.sha256(data).hexdigest() != VOCAB_SHA256:
        return False
    where.parent.mkdir(parents=True, exist_ok=True)
    tmp = where.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, where)
    return True


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: the character a byte-level BPE vocabulary shows -> byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def vocab_from_tokenizer(tokenizer: Any) -> list[tuple[int, bytes]] | None:
    """The (rank, bytes) table of a byte-level BPE tokenizer's ordinary tokens (HF's `get_vocab`), or None."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # not an HF tokenizer
        return None
    if len(vocab) < VOCAB_SIZE:
        return None
    decode = _byte_decoder()
    out = []
    for token, rank in vocab.items():
        if rank < VOCAB_SIZE:
            try:
                out.append((rank, bytes(decode[c] for c in token)))
            except KeyError:  # not byte-level
                return None
    return out


def vocab_from_quicktok() -> list[tuple[int, bytes]] | None:
    """The o200k table that the `quicktok-v1` package ships (`quicktok/data/o200k.vocab`: a u32 count, then per
    token a u16 length, its bytes and a u32 rank, little-endian), or None when it is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("quicktok")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "o200k.vocab"
    try:
        data = path.read_bytes()
    except OSError:
        return None
    (count,), off, out = struct.unpack_from("<I", data, 0), 4, []
    for _ in range(count):
        (length,) = struct.unpack_from("<H", data, off)
        token = data[off + 2:off + 2 + length]
        (rank,) = struct.unpack_from("<I", data, off + 2 + length)
        out.append((rank, token))
        off += 6 + length
    return out


def vocab_dir(tokenizer: Any = None) -> str | None:
    """A folder holding o200k_base.tiktoken for harmony, made if need be (see the module's doc); None leaves
    harmony to download it."""
    if os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        return os.environ["TIKTOKEN_ENCODINGS_BASE"]
    where = cache_dir() / VOCAB_FILE
    if _valid(where):
        return str(where.parent)
    for source, table in (("the served tokenizer", lambda: vocab_from_tokenizer(tokenizer)),
                          ("quicktok-v1", vocab_from_quicktok)):
        ranked = table()
        if ranked is not None and _write(ranked, where):
            logger.info("harmony: wrote the o200k_base vocabulary from %s to %s", source, where)
            return str(where.parent)
    return None


_ENCODING: Any = None


def encoding(tokenizer: Any = None) -> Any:
    """harmony's gpt-oss encoding (loaded once); HarmonyUnavailable saying what is missing."""
    global _ENCODING
    if _ENCODING is None:
        try:
            import openai_harmony
        except ImportError:
            raise HarmonyUnavailable("the harmony format (gpt-oss) needs the openai-harmony package: "
                                     "pip install openai-harmony") from None
        folder = vocab_dir(tokenizer)
        if folder is not None:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = folder  # where harmony looks for its vocabulary
        try:
            _ENCODING = openai_harmony.load_harmony_encoding(openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
        except Exception as exc:  # HarmonyError: no network and no vocabulary
            raise HarmonyUnavailable(
                f"openai-harmony could not load its o200k_base vocabulary ({exc}); offline, set "
                f"TIKTOKEN_ENCODINGS_BASE to a folder with {VOCAB_FILE} or pip install quicktok-v1") from None
    return _ENCODING


@dataclass
class HarmonyCall:
    """A message to `functions.NAME` as far as it is written."""

    name: str
    args: str = ""  # the JSON arguments as written so far
    done: bool = False  # the message ended


@dataclass
class HarmonyRead:
    """What an output says so far."""

    reasoning: str = ""  # the analysis messages' text, joined by a blank line
    content: str = ""  # the final messages' and preambles' text
    calls: list[HarmonyCall] = field(default_factory=list)
    reasoning_tokens: int = 0  # tokens of analysis messages, their headers and ends included


class HarmonyReader:
    """One output read as it grows (`feed` the new text; `finish` at the end)."""

    def __init__(self, enc: Any) -> None:
        from openai_harmony import Role, StreamableParser

        self.enc = enc
        self.parser = StreamableParser(enc, role=Role.ASSISTANT)
        self.text = ""
        self.read = HarmonyRead()
        self.broken = False  # the parser gave up: the rest is content as written
        self.finished = False
        self._pending: list[int] = []  # tokens of the message being read whose text went nowhere yet
        self._message = 0  # index of the message being read
        self._tokens = 0  # its tokens so far
        self._call: int | None = None  # its index in read.calls when it is a call
        self._wrote = False  # it gave out text

    def feed(self, delta: str) -> HarmonyRead:
        self.text += delta
        if self.broken:
            self.read.content += delta
            return self.read
        for token in self.enc.encode(delta, allowed_special="all"):
            self._token(token)
            if self.broken:
                break
        return self.read

    def _token(self, token: int) -> None:
        from openai_harmony import HarmonyError

        p = self.parser
        self._pending.append(token)
        self._tokens += 1
        try:
            p.process(token)
        except HarmonyError:
            self._give_up()
            return
        delta = p.last_content_delta
        if delta:
            self._pending.clear()
            recipient = p.current_recipient
            if recipient is not None and recipient.startswith(FUNCTIONS):
                if self._call is None:
                    self._call = len(self.read.calls)
                    self.read.calls.append(HarmonyCall(name=recipient[len(FUNCTIONS):]))
                self.read.calls[self._call].args += delta
            elif recipient is not None:
                pass  # a message to a built-in tool
            elif p.current_channel == "analysis":
                if self.read.reasoning and not self._wrote:
                    self.read.reasoning += "\n\n"
                self.read.reasoning += delta
            else:
                self.read.content += delta
            self._wrote = True
        if len(p.messages) > self._message:
            self._end_message()

    def _end_message(self) -> None:
        message = self.parser.messages[-1]
        if message.channel == "analysis":
            self.read.reasoning_tokens += self._tokens
        recipient = message.recipient or ""
        if self._call is not None:
            self.read.calls[self._call].done = True
        elif recipient.startswith(FUNCTIONS):  # a call with empty arguments
            self.read.calls.append(HarmonyCall(name=recipient[len(FUNCTIONS):], done=True))
        self._message, self._tokens, self._call, self._wrote = len(self.parser.messages), 0, None, False
        self._pending.clear()

    def _give_up(self) -> None:
        """Text harmony cannot read: from the message it is in on, the output is content as written."""
        self.broken = True
        if self._pending:
            self.read.content += self.enc.decode(self._pending)
        self._pending.clear()

    def finish(self) -> HarmonyRead:
        """The end of the output: the message being written ends with it."""
        if self.finished:
            return self.read
        self.finished = True
        if self.broken:
            return self.read
        from openai_harmony import HarmonyError

        try:
            self.parser.process_eos()
        except HarmonyError:  # cut off in a header, or never harmony
            if self._message == 0 and not self._wrote:
                self._give_up()  # nothing read: the output is plain text
            return self.read
        if len(self.parser.messages) > self._message:
            self._end_message()
        return self.read


class HarmonyReasoningStream:
    """The reasoning splitter of a harmony output (ReasoningStream's interface): the analysis messages are the
    reasoning; the answer is the final and preamble text, or with `markup` (the `openai` tool parser reads the
    answer next) the output as written, for that parser to read its calls from."""

    def __init__(self, fmt: Any, tokenizer: Any = None, markup: bool = False) -> None:
        self.fmt = fmt
        self.reader = HarmonyReader(encoding(tokenizer))
        self.markup = markup
        self.state = "inside"  # ReasoningStream's attribute (harmony requests are never gated: prepare_reasoning)
        self.finished = False
        self.reasoning_text = ""
        self.answer_text = ""

    def _out(self, delta: str, read: HarmonyRead) -> tuple[str, str]:
        reasoning = read.reasoning[len(self.reasoning_text):]
        answer = delta if self.markup else read.content[len(self.answer_text):]
        self.reasoning_text += reasoning
        self.answer_text += answer
        return reasoning, answer

    def feed(self, delta: str) -> tuple[str, str]:
        return self._out(delta, self.reader.feed(delta))

    def finish(self) -> tuple[str, str]:
        self.finished = True
        return self._out("", self.reader.finish())

    def reasoning_tokens(self, token_ids: list[int], tokenizer: Any) -> int:
        """Tokens of the analysis messages (counted in harmony's o200k, which is gpt-oss's own tokenizer); all of
        them when the output is thinking only (cut off while thinking)."""
        read = self.reader.read
        if read.reasoning and not read.content and not read.calls:
            return len(token_ids)
        return min(len(token_ids), read.reasoning_tokens)
