"""`servelm bench detokenize`: microseconds a token of the incremental detokenizer, its fast path (tokenizers'
DecodeStream) against the two-decode window, with N streams advancing together as in a scheduler step.

    servelm bench detokenize [--model-path PATH] [--streams 32] [--tokens 1200] [--rounds 5]

The text is the prose in tests/data (or a built-in paragraph) with accents, CJK and emoji appended, so that
characters split across tokens; both paths must give the same text.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

SAMPLE = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
          "want of a wife. ")
EXTRA = " héllo wörld, 日本語のテキスト 🙂🚀 «guillemets» — dashes…"


def _text() -> str:
    data = Path(__file__).resolve().parents[2] / "tests" / "data" / "pride_and_prejudice_ch1-2.txt"
    base = data.read_text()[:6000] if data.is_file() else SAMPLE * 60
    return base + EXTRA * 20


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="servelm bench detokenize", description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="Model (its tokenizer); default: the embedded model.")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=1200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    from servelm.managers.detokenizer import IncrementalDetokenizer
    from servelm.model_loader.default_model import model_path_or_default
    from servelm.model_loader.tokenizer import load_tokenizer

    tok = load_tokenizer(model_path_or_default(args.model_path))
    ids = tok.encode(_text(), add_special_tokens=False)[:args.tokens]

    def run(fast: bool) -> tuple[float, str]:
        detoks = [IncrementalDetokenizer(tok) for _ in range(args.streams)]
        if not fast:
            for d in detoks:
                d._stream = None
        t0 = time.perf_counter()
        for token in ids:
            for d in detoks:
                d.add(token)
        elapsed = time.perf_counter() - t0
        detoks[0].flush()
        return elapsed / (len(ids) * args.streams) * 1e6, detoks[0].text

    if IncrementalDetokenizer(tok)._stream is None:
        print("this tokenizer has no fast path (not a Rust tokenizer, or it cleans up spaces): window only")
    window, fast, same = [], [], True
    for _ in range(args.rounds):  # interleaved rounds
        w, wt = run(False)
        window.append(w)
        if IncrementalDetokenizer(tok)._stream is not None:
            f, ft = run(True)
            fast.append(f)
            same = same and ft == wt
    print(f"{len(ids)} tokens x {args.streams} streams, medians of {args.rounds} rounds: two-decode window "
          f"{statistics.median(window):.2f} us/token" + (f", DecodeStream {statistics.median(fast):.2f} us/token "
                                                        f"(same text: {same})" if fast else ""))
    return 0 if same else 1
