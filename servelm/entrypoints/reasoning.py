"""Reasoning output (`--reasoning-parser`, vLLM's and SGLang's flag): the text a model thinks in before it
answers goes to `reasoning_content` (and `reasoning`, vLLM's newer name for it), the answer to `content`.

A format is the pair of markers around the thinking and where an output starts:
* `qwen3` (Qwen3, QwQ): `<think>` ... `</think>`, written by the model itself; an output that does not open
  the block is all answer (with `enable_thinking: false` the template closes an empty block in the prompt).
* `deepseek_r1` (DeepSeek-R1 and its distills): the same markers, but the output starts inside the block (the
  template opens it in the prompt; R1-0528 writes `<think>` again, which is dropped); an output without
  `</think>` is all reasoning (it was cut off while thinking).
* `openai_gptoss` (vLLM's name; `gpt-oss`, SGLang's): gpt-oss's harmony `analysis` messages, read with the
  openai-harmony package by servelm.entrypoints.harmony (not by markers).
Either way, a prompt that ends with the opening marker (Qwen3-Thinking-2507, DeepSeek-R1) starts the output
inside the block, and one that ends with the closing marker starts it in the answer.

`ReasoningStream` splits an output delta by delta, holding back only what may be the start of a marker;
a finished output goes through the same machine, so streamed and whole replies agree. Whitespace right after
a marker and right before `</think>` is dropped (Qwen3 writes `<think>\\n`, `\\n</think>\\n\\n`).

Plugins: an entry point in the group `servelm.reasoning_parsers` naming a `ReasoningFormat` (or a callable
returning one) adds a format by its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from servelm.entrypoints.tool_calls import held_prefix
from servelm.plugins import with_plugins

ENTRY_POINT_GROUP = "servelm.reasoning_parsers"


@dataclass(frozen=True)
class ReasoningFormat:
    """How one model family marks its thinking."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    starts_inside: bool = False  # the output begins in the reasoning whatever the prompt ends with
    harmony: bool = False  # OpenAI's harmony messages (servelm.entrypoints.harmony reads them), not markers


_HARMONY = {"start": "<|channel|>analysis<|message|>", "end": "<|end|>", "harmony": True}
BUILTIN = {f.name: f for f in (ReasoningFormat("qwen3"), ReasoningFormat("deepseek_r1", starts_inside=True),
                               ReasoningFormat("openai_gptoss", **_HARMONY), ReasoningFormat("gpt-oss", **_HARMONY))}


def formats() -> dict[str, ReasoningFormat]:
    """The built-in formats and those of installed plugins (a plugin's name may not shadow a built-in)."""

    def convert(obj: Any) -> ReasoningFormat | None:
        fmt = obj() if callable(obj) and not isinstance(obj, ReasoningFormat) else obj
        return fmt if isinstance(fmt, ReasoningFormat) else None

    return with_plugins(ENTRY_POINT_GROUP, BUILTIN, convert, "reasoning parser (a ReasoningFormat)")


def resolve(name: str | None, chat_template: str | None) -> ReasoningFormat | None:
    """The format `--reasoning-parser NAME` asks for; `auto` reads the chat template (None when it shows no
    thinking markers). ValueError with the choices for an unknown name."""
    if name is None:
        return None
    if name == "auto":
        return auto_format(chat_template)
    known = formats()
    if name not in known:
        raise ValueError(f"--reasoning-parser {name!r} is not known; choose one of: auto, {', '.join(known)}")
    return known[name]


def auto_format(chat_template: str | None) -> ReasoningFormat | None:
    """The format a chat template implies, where that is unambiguous: both `<think>` markers in it, and
    `enable_thinking` (Qwen3's switch) for qwen3, else deepseek_r1 (its templates open the block in the prompt,
    which the prompt check handles for Qwen3-Thinking-2507 as well)."""
    template = chat_template or ""
    if "<|channel|>" in template and "analysis" in template:
        return BUILTIN["openai_gptoss"]
    if "<think>" not in template or "</think>" not in template:
        return None
    return BUILTIN["qwen3" if "enable_thinking" in template else "deepseek_r1"]


class ReasoningStream:
    """One output split into reasoning and answer, delta by delta.

    States: "opening" (the output may still open a block: leading whitespace and a prefix of the opening
    marker are held; an answer gets them back), "inside" (reasoning: a tail that may start the closing
    marker, and whitespace before it, are held), "answer" (all the rest; whitespace right after the closing
    marker is dropped)."""

    def __init__(self, fmt: ReasoningFormat, prompt_text: str = "") -> None:
        self.fmt = fmt
        tail = prompt_text.rstrip()
        if tail.endswith(fmt.end):
            self.state = "answer"
        elif tail.endswith(fmt.start) or fmt.starts_inside:
            self.state = "inside"
        else:
            self.state = "opening"
        self.inside_from_start = self.state == "inside"
        self._buf = ""  # text not yet given out
        self._lstrip = self.state != "opening"  # drop whitespace at the start of the current part
        self.finished = False
        self._closed_here = False  # the output closed a block (so it thought, maybe with no text)
        self.reasoning_text = ""  # what went out as reasoning so far
        self.answer_text = ""  # and as answer

    def feed(self, delta: str) -> tuple[str, str]:
        """Add `delta`; returns the (reasoning, answer) text that can go out now."""
        self._buf += delta
        return self._step(final=False)

    def finish(self) -> tuple[str, str]:
        """The held-back text at the end of the output: (reasoning, answer)."""
        self.finished = True
        return self._step(final=True)

    def _step(self, final: bool) -> tuple[str, str]:
        fmt, reasoning, answer = self.fmt, "", ""
        while True:
            if self._lstrip:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._lstrip = False
            if self.state == "opening":  # an answer keeps its leading whitespace; a block drops it
                head = self._buf.lstrip()
                if head.startswith(fmt.start):
                    self._buf, self.state, self._lstrip = head[len(fmt.start):], "inside", True
                    continue
                if fmt.start.startswith(head) and not final:
                    break  # may still become the opening marker
                self.state = "answer"
                continue
            if self.state == "inside":
                if self.inside_from_start:  # R1-0528 writes the opening marker again: dropped
                    if self._buf.startswith(fmt.start):
                        self._buf, self._lstrip, self.inside_from_start = self._buf[len(fmt.start):], True, False
                        continue
                    if fmt.start.startswith(self._buf) and not final:
                        break
                self.inside_from_start = False
                at = self._buf.find(fmt.end)
                if at >= 0:
                    reasoning += self._buf[:at].rstrip()
                    self._buf, self.state, self._lstrip = self._buf[at + len(fmt.end):], "answer", True
                    self._closed_here = True
                    continue
                if final:
                    reasoning += self._buf.rstrip()
                    self._buf = ""
                    break
                body = self._buf[:len(self._buf) - held_prefix(self._buf, fmt.end)]
                keep = len(body.rstrip())  # whitespace before a possible closing marker waits too
                reasoning += self._buf[:keep]
                self._buf = self._buf[keep:]
                break
            answer += self._buf
            self._buf = ""
            break
        self.reasoning_text += reasoning
        self.answer_text += answer
        return reasoning, answer

    def reasoning_tokens(self, token_ids: list[int], tokenizer: Any) -> int:
        """Of a finished output's tokens, how many were thinking (usage's `reasoning_tokens`): those up to and
        including the closing marker; all of them when the output ended while thinking; 0 without a block."""
        if self.state != "answer":
            return len(token_ids)
        if not self._closed_here:
            return 0
        end = marker_token(tokenizer, self.fmt.end)
        if end is not None and end in token_ids:
            return token_ids.index(end) + 1
        # a closing marker of several tokens: the thinking's text and the marker, tokenized again
        return min(len(token_ids), len(tokenizer.encode(self.reasoning_text + self.fmt.end, add_special_tokens=False)))


def split(fmt: ReasoningFormat, text: str, prompt_text: str = "") -> tuple[str, str]:
    """(reasoning, answer) of a finished output."""
    stream = ReasoningStream(fmt, prompt_text)
    r1, a1 = stream.feed(text)
    r2, a2 = stream.finish()
    return r1 + r2, a1 + a2


def prompt_tail(manager: Any, ids: list[int], tokens: int = 16) -> str:
    """The text of the prompt's last tokens (enough to see a marker it ends with)."""
    return manager.decode(ids[-tokens:]) if ids else ""


def marker_token(tokenizer: Any, marker: str) -> int | None:
    """The id of `marker` when the tokenizer has it as one token (Qwen3's and DeepSeek-R1's do), else None."""
    try:
        ids = tokenizer.encode(marker, add_special_tokens=False)
    except Exception:  # a tokenizer without an encode of its own shape
        return None
    return int(ids[0]) if len(ids) == 1 else None
