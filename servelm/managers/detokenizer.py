"""Incremental detokenisation with stop-string handling.

Decoding each new token on its own breaks multi-byte characters and
SentencePiece spaces, so, as in vLLM, we decode a small window
(prefix_offset..end) and emit only what the window adds over the previous
one, waiting while the text ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import regex

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)
# A client's stop_regex runs in the scheduler loop: a pathological pattern (catastrophic backtracking) gets
# this long per search (the `regex` module's timeout), then is dropped rather than stall every request.
STOP_REGEX_TIMEOUT_S = 0.05


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str] | None = None,
                 skip_special_tokens: bool = True, stop_regex: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop_regex = [regex.compile(p) for p in stop_regex or []]
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # confirmed output text (stop strings trimmed)
        self.sent = 0  # characters of `text` already handed out
        self._stop_scan_from = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str | None:
        """Append a token; returns the stop string (or stop_regex pattern) it completed, if any."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._check_stop() or self._check_stop_regex()

    def flush(self) -> None:
        """At the end: emit whatever is still pending, even an incomplete character."""
        if self.read_offset < len(self.ids):
            prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
            self.text += self._decode(self.ids[self.prefix_offset:])[len(prefix_text):]
            self.prefix_offset = self.read_offset = len(self.ids)

    def _check_stop(self) -> str | None:
        if not self.stop:
            return None
        start = max(0, self._stop_scan_from - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        self._stop_scan_from = len(self.text)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def _check_stop_regex(self) -> str | None:
        """SGLang's stop_regex: the pattern the text now matches; the match is kept in the text (as SGLang)."""
        for pattern in list(self.stop_regex):
            try:
                if pattern.search(self.text, timeout=STOP_REGEX_TIMEOUT_S):
                    return pattern.pattern
            except TimeoutError:
                logger.warning("stop_regex %r took over %.2f s on %d characters: no longer checked",
                               pattern.pattern, STOP_REGEX_TIMEOUT_S, len(self.text))
                self.stop_regex.remove(pattern)
        return None

    def take(self, finished: bool) -> str:
        """New text to hand out. While running, hold back a tail that could still become a stop string."""
        end = len(self.text) if finished else max(self.sent, len(self.text) - max(self.max_stop_len - 1, 0))
        out = self.text[self.sent:end]
        self.sent = end
        return out
