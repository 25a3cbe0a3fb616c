"""The incremental detokenizer on a byte-level tokenizer: a character split across tokens is held back
until complete, a stop string across tokens is found and trimmed, and its possible start is held back."""

from __future__ import annotations

from servelm.managers.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """Token id = one byte; decoding joins the bytes (an incomplete character decodes to U+FFFD)."""

    SPECIAL = 256

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i for i in ids if i != self.SPECIAL)
        text = data.decode("utf-8", errors="replace")
        return text if skip_special_tokens or self.SPECIAL not in ids else text + "<s>"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def feed(detok: IncrementalDetokenizer, text: str) -> tuple[list[str], str | None]:
    """The pieces handed out token by token, and the stop string met (if any)."""
    pieces = []
    for token in ByteTokenizer().encode(text):
        stop = detok.add(token)
        pieces.append(detok.take(stop is not None))
        if stop is not None:
            return pieces, stop
    return pieces, None


def test_a_multibyte_character_is_held_back_until_complete() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer())  # type: ignore[arg-type]
    pieces, stop = feed(detok, "aé😀b")
    assert stop is None and "\ufffd" not in "".join(pieces)
    # "é" is 2 bytes, "😀" 4: nothing goes out until the last byte of each.
    assert pieces == ["a", "", "é", "", "", "", "😀", "b"]


def test_flush_emits_an_incomplete_tail() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer())  # type: ignore[arg-type]
    for token in "é".encode()[:1]:
        detok.add(token)
    assert detok.take(False) == ""
    detok.flush()
    assert detok.take(True) == "\ufffd"


def test_a_stop_string_across_tokens_is_found_and_trimmed() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=["STOP", "x"])  # type: ignore[arg-type]
    pieces, stop = feed(detok, "abcSTOPdef")
    assert stop == "STOP"
    assert "".join(pieces) == "abc" and detok.text == "abc"
    # The last 3 characters (len("STOP") - 1) are held back while they could still start the stop string.
    assert pieces == ["", "", "", "a", "b", "c", ""]


def test_the_earliest_stop_string_wins() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=["cd", "bcde"])  # type: ignore[arg-type]
    _, stop = feed(detok, "abcdef")
    assert stop == "cd" and detok.text == "ab"


def test_special_tokens_are_skipped_or_kept() -> None:
    for skip, expected in ((True, "hi"), (False, "hi<s>")):
        detok = IncrementalDetokenizer(ByteTokenizer(), skip_special_tokens=skip)  # type: ignore[arg-type]
        for token in [*b"hi", ByteTokenizer.SPECIAL]:
            detok.add(token)
        detok.flush()
        assert detok.take(True) == expected


def test_stop_regex_keeps_the_match_and_drops_a_pathological_pattern() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), stop_regex=["[0-9]{2}"])  # type: ignore[arg-type]
    pieces, stop = feed(detok, "ab1c23def")
    assert stop == "[0-9]{2}" and "".join(pieces) == "ab1c23"  # the match stays in the text, as SGLang's
    # Catastrophic backtracking is cut off by the timeout: the pattern is dropped, the request goes on.
    slow = IncrementalDetokenizer(ByteTokenizer(), stop_regex=["(x+x+)+y"])  # type: ignore[arg-type]
    slow.text = "x" * 5000
    assert slow._check_stop_regex() is None and slow.stop_regex == []


# ------------------------------------------------------------------ the fast path: tokenizers' DecodeStream
def _default_tokenizer():
    from servelm.model_loader.default_model import default_model_path
    from servelm.model_loader.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path())


PROSE = "It is a truth universally acknowledged — héllo wörld, 日本語 🙂🙂 «quotes»\nand a new line."


def _pieces(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None]:
    pieces = []
    for token in ids:
        stop = detok.add(token)
        pieces.append(detok.take(stop is not None))
        if stop is not None:
            return pieces, stop
    detok.flush()
    pieces.append(detok.take(True))
    return pieces, None


def test_a_fast_tokenizer_streams_with_decode_stream_and_gives_the_windows_pieces() -> None:
    tok = _default_tokenizer()
    ids = tok.encode(PROSE, add_special_tokens=False)
    fast = IncrementalDetokenizer(tok)
    window = IncrementalDetokenizer(tok)
    window._stream = None  # the two-decode window
    assert fast._stream is not None
    got, want = _pieces(fast, ids), _pieces(window, ids)
    assert got == want and "".join(got[0]) == PROSE and "\ufffd" not in "".join(got[0])
    assert "" in got[0]  # an emoji's first tokens wait for its last


def test_the_fast_path_flushes_an_incomplete_character_and_finds_stop_strings() -> None:
    tok = _default_tokenizer()
    emoji = tok.encode("🙂", add_special_tokens=False)
    assert len(emoji) > 1
    detok = IncrementalDetokenizer(tok)
    detok.add(emoji[0])
    assert detok.take(False) == ""
    detok.flush()
    assert detok.take(True) == tok.decode(emoji[:1])  # as decode() shows the cut-off bytes
    detok = IncrementalDetokenizer(tok, stop=["wörld"])
    pieces, stop = _pieces(detok, tok.encode(PROSE, add_special_tokens=False))
    assert stop == "wörld" and "".join(pieces) == PROSE[:PROSE.index("wörld")]
