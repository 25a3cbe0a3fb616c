"""`servelm bench serving`: load-test any OpenAI-compatible server (servelm, vLLM, SGLang).

Requests go to `/v1/completions` with `stream: true` and the prompt as token
ids, so input lengths are exact whatever the server's tokenizer does with
text; output lengths are fixed with `ignore_eos` (a vLLM/SGLang extension
that servers without it ignore). Output token counts come from the final
`usage` chunk (`stream_options.include_usage`) when the server sends one.

Datasets:
* `random`: `--num-prompts` prompts of random token ids; input and output
  lengths drawn uniformly from [len * range_ratio, len].
* `generated-shared-prefix`: `--gsp-num-groups` groups, each sharing one
  long random system prompt, with `--gsp-prompts-per-group` short questions
  (what a prefix cache speeds up).
* `chat`: open questions as chat prompts (explain, compare, write a short
  story), `--random-output-len` tokens each: text whose n-grams seldom repeat.
* `copy`: chat prompts that ask the model to repeat, or lightly edit, a block
  of `--copy-text-len` tokens of Python source (servelm's own files), with as
  many output tokens: the copy-heavy work that speculative decoding speeds up.

Arrivals: `--request-rate` requests/s as a Poisson process (inf = all at
once), capped by `--max-concurrency` requests in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    output_len: int
    text: str | None = None  # --text-prompts: the prompt sent as this text instead of its token ids


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    input_len: int = 0
    output_len: int = 0
    cached_tokens: int | None = None  # prompt tokens the server's prefix cache served (usage.prompt_tokens_details)
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


# ----------------------------------------------------------------- datasets
def _vocab_ids(tokenizer: Any) -> list[int]:
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return [i for i in range(len(tokenizer)) if i not in special]


def random_dataset(tokenizer: Any, num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                   rng: random.Random) -> list[BenchRequest]:
    """Prompts of random (non-special) token ids with lengths uniform in [len * range_ratio, len]."""
    vocab = _vocab_ids(tokenizer)
    reqs = []
    for _ in range(num_prompts):
        n_in = rng.randint(max(1, int(input_len * range_ratio)), max(1, input_len))
        n_out = rng.randint(max(1, int(output_len * range_ratio)), max(1, output_len))
        reqs.append(BenchRequest([rng.choice(vocab) for _ in range(n_in)], n_out))
    return reqs


def shared_prefix_dataset(tokenizer: Any, num_groups: int, prompts_per_group: int, system_prompt_len: int,
                          question_len: int, output_len: int, rng: random.Random) -> list[BenchRequest]:
    """Groups of prompts sharing one long system prompt, interleaved across groups."""
    vocab = _vocab_ids(tokenizer)
    groups = []
    for _ in range(num_groups):
        prefix = [rng.choice(vocab) for _ in range(system_prompt_len)]
        groups.append([BenchRequest(prefix + [rng.choice(vocab) for _ in range(question_len)], output_len)
                       for _ in range(prompts_per_group)])
    # Round-robin, so that concurrent requests mostly belong to different groups.
    return [g[i] for i in range(prompts_per_group) for g in groups]


def copy_dataset(tokenizer: Any, num_prompts: int, text_len: int, rng: random.Random) -> list[BenchRequest]:
    """Chat prompts asking to repeat or lightly edit `text_len` tokens of Python source; output_len = text_len."""
    from pathlib import Path

    import servelm

    files = sorted(Path(servelm.__file__).parent.rglob("*.py"))
    sources = [f.read_text(encoding="utf-8") for f in files]
    sources = [s for s in sources if len(s) > 8 * text_len]
    tasks = ["Repeat the following code exactly, with no comment:",
             "Rewrite the following code with every `self` renamed to `this`, and nothing else changed:",
             "Copy the following code, adding nothing:"]
    reqs = []
    for _ in range(num_prompts):
        ids = tokenizer.encode(rng.choice(sources), add_special_tokens=False)
        start = rng.randrange(0, max(1, len(ids) - text_len))
        block = tokenizer.decode(ids[start: start + text_len])
        messages = [{"role": "user", "content": f"{rng.choice(tasks)}\n\n```python\n{block}\n```"}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
            prompt = prompt["input_ids"]
        reqs.append(BenchRequest(list(prompt), text_len))
    return reqs


_TOPICS = ["how a CPU cache works", "why the sky is blue", "the history of the printing press",
           "how vaccines train the immune system", "what a hash table is", "the water cycle",
           "how bees make honey", "the causes of the French Revolution", "how a compiler works",
           "photosynthesis", "the rules of chess", "how tides happen", "what inflation is",
           "how airplanes fly", "the life of a star", "how to bake bread"]
_ASKS = ["Explain {} to a curious teenager.", "Write a short story that involves {}.",
         "Give a detailed overview of {}.", "Write a blog post about {}."]


def chat_dataset(tokenizer: Any, num_prompts: int, output_len: int, rng: random.Random) -> list[BenchRequest]:
    """Open questions as chat prompts (what n-gram drafts seldom help): `output_len` tokens each."""
    reqs = []
    for _ in range(num_prompts):
        messages = [{"role": "user", "content": rng.choice(_ASKS).format(rng.choice(_TOPICS))}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
            prompt = prompt["input_ids"]
        reqs.append(BenchRequest(list(prompt), output_len))
    return reqs


def speculation_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The run's speculative decoding figures from two /server_info answers ({} when it is off)."""
    if "spec_decode_num_drafts" not in after:
        return {}
    d = {k: after[k] - before.get(k, 0) for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                                  "spec_decode_num_accepted_tokens")}
    drafts = d["spec_decode_num_drafts"]
    d["spec_decode_mean_acceptance_length"] = 1 + d["spec_decode_num_accepted_tokens"] / drafts if drafts else None
    return d


def speculation_line(d: dict[str, Any]) -> str | None:
    """The one line a benchmark prints about speculation (from `speculation_delta`), or None when it was off."""
    if d.get("spec_decode_num_drafts") is None:
        return None
    mean = d["spec_decode_mean_acceptance_length"]
    if not mean:
        return "Speculative decoding: no drafts"
    return (f"Speculative decoding: {d['spec_decode_num_drafts']} drafts, {d['spec_decode_num_accepted_tokens']} of "
            f"{d['spec_decode_num_draft_tokens']} draft tokens accepted, mean acceptance length {mean:.2f}")


def _server_info(base_url: str, api_key: str | None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/server_info", headers=headers, timeout=30)
        return r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}  # another server (vLLM, SGLang) may not have it


# ------------------------------------------------------------------ client
async def send_request(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest,
                       headers: dict[str, str]) -> RequestResult:
    """One streaming completion; times the first token, each following chunk and the whole request."""
    body = {"model": model, "prompt": req.text if req.text is not None else req.prompt_ids,
            "max_tokens": req.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(input_len=len(req.prompt_ids))
    start = time.perf_counter()
    last = start
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    result.error = str(obj["error"])
                    return result
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                    if req.text is not None and isinstance(obj["usage"].get("prompt_tokens"), int):
                        result.input_len = obj["usage"]["prompt_tokens"]  # the server's count of the text
                    details = obj["usage"].get("prompt_tokens_details") or {}
                    if isinstance(details.get("cached_tokens"), int):
                        result.cached_tokens = details["cached_tokens"]
                if any(c.get("text") for c in obj.get("choices") or []):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - start
    result.output_len = usage_tokens if usage_tokens is not None else chunks
    result.success = chunks > 0
    if not result.success:
        result.error = "no output"
    return result


async def run_benchmark(base_url: str, model: str, requests: list[BenchRequest], request_rate: float,
                        max_concurrency: int | None, api_key: str | None, seed: int,
                        warmup: int = 1) -> tuple[list[RequestResult], float]:
    """Send the first `warmup` requests one by one (unmeasured), then the rest as measured load;
    return the measured results and duration."""
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    rng = np.random.default_rng(seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as client:
        for req in requests[:warmup]:  # also pays for first-call costs (compilation, allocations)
            short = BenchRequest(req.prompt_ids, min(req.output_len, 8), req.text)
            warm = await send_request(client, url, model, short, headers)
            if not warm.success:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def limited(req: BenchRequest) -> RequestResult:
            if sem is None:
                return await send_request(client, url, model, req, headers)
            async with sem:
                return await send_request(client, url, model, req, headers)

        start = time.perf_counter()
        tasks = []
        for req in requests[warmup:]:
            tasks.append(asyncio.create_task(limited(req)))
            if math.isfinite(request_rate) and request_rate > 0:
                await asyncio.sleep(float(rng.exponential(1.0 / request_rate)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


# ---------------------------------------------------------------- metrics
def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Throughputs and latency percentiles (milliseconds) over the successful requests."""
    ok = [r for r in results if r.success]
    ttft = np.array([r.ttft for r in ok] or [0.0]) * 1000
    itl = np.array([x for r in ok for x in r.itl] or [0.0]) * 1000
    e2e = np.array([r.e2e for r in ok] or [0.0]) * 1000
    total_in = sum(r.input_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    reported = [r for r in ok if r.cached_tokens is not None]
    # The prefix-cache hit rate as the clients saw it: cached prompt tokens over prompt tokens (so it is the same
    # measure behind a router, and for any server that reports cached_tokens).
    hit_rate = (sum(r.cached_tokens or 0 for r in reported) / max(1, sum(r.input_len for r in reported))
                if reported else None)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "input_throughput": total_in / duration,
        "output_throughput": total_out / duration, "total_throughput": (total_in + total_out) / duration,
        "mean_ttft_ms": float(ttft.mean()), "median_ttft_ms": float(np.median(ttft)),
        "p99_ttft_ms": float(np.percentile(ttft, 99)),
        "mean_itl_ms": float(itl.mean()), "median_itl_ms": float(np.median(itl)),
        "p95_itl_ms": float(np.percentile(itl, 95)), "p99_itl_ms": float(np.percentile(itl, 99)),
        "mean_e2e_ms": float(e2e.mean()), "median_e2e_ms": float(np.median(e2e)),
        "prefix_cache_hit_rate": hit_rate,
        "errors": sorted({r.error for r in results if not r.success})[:5],
    }


def format_summary(s: dict[str, Any], title: str) -> str:
    rows = [
        ("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
        ("Benchmark duration (s):", f"{s['duration_s']:.2f}"),
        ("Total input tokens:", s["total_input_tokens"]), ("Total generated tokens:", s["total_output_tokens"]),
        ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
        ("Input token throughput (tok/s):", f"{s['input_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{s['total_throughput']:.2f}"),
        ("-Time to First Token-", None),
        ("Mean TTFT (ms):", f"{s['mean_ttft_ms']:.2f}"), ("Median TTFT (ms):", f"{s['median_ttft_ms']:.2f}"),
        ("P99 TTFT (ms):", f"{s['p99_ttft_ms']:.2f}"),
        ("-Inter-Token Latency-", None),
        ("Mean ITL (ms):", f"{s['mean_itl_ms']:.2f}"), ("Median ITL (ms):", f"{s['median_itl_ms']:.2f}"),
        ("P95 ITL (ms):", f"{s['p95_itl_ms']:.2f}"), ("P99 ITL (ms):", f"{s['p99_itl_ms']:.2f}"),
        ("-End-to-End Latency-", None),
        ("Mean E2E Latency (ms):", f"{s['mean_e2e_ms']:.2f}"),
        ("Median E2E Latency (ms):", f"{s['median_e2e_ms']:.2f}"),
    ]
    if s.get("prefix_cache_hit_rate") is not None:
        rows += [("-Prefix Cache-", None), ("Hit rate (cached / prompt tokens):", f"{s['prefix_cache_hit_rate']:.3f}")]
    width = 50
    lines = [f" {title} ".center(width, "=")]
    for label, value in rows:
        lines.append(label.strip("-").center(width, "-") if value is None else f"{label:<40}{value:>10}")
    lines.append("=" * width)
    return "\n".join(lines)


# -------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="servelm bench serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="Server URL (without /v1).")
    p.add_argument("--model", default=None, help="Model id (default: the first of /v1/models).")
    p.add_argument("--tokenizer", default=None,
                   help="Tokenizer (HF folder or .gguf) used to draw prompt token ids (default: the default model's).")
    p.add_argument("--api-key", default=None, help="Bearer token for the server.")
    p.add_argument("--dataset-name", default="random", choices=["random", "generated-shared-prefix", "copy", "chat"])
    p.add_argument("--num-prompts", type=int, default=64, help="Requests of the random dataset.")
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=1.0,
                   help="Lengths are drawn uniformly from [len * ratio, len].")
    p.add_argument("--copy-text-len", type=int, default=400, help="Tokens of the block each copy prompt repeats.")
    p.add_argument("--gsp-num-groups", type=int, default=8)
    p.add_argument("--gsp-prompts-per-group", type=int, default=4)
    p.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    p.add_argument("--gsp-question-len", type=int, default=32)
    p.add_argument("--gsp-output-len", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Requests per second, Poisson arrivals (default inf: all at once).")
    p.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight.")
    p.add_argument("--warmup-requests", type=int, default=1, help="Unmeasured requests sent first.")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--flush-cache", action="store_true",
                   help="POST /flush_cache first, so prompts of an earlier run with the same seed are not cache "
                        "hits (servelm, SGLang).")
    p.add_argument("--text-prompts", action="store_true",
                   help="Send each prompt as its text (decoded) instead of token ids: what a router's text-based "
                        "cache-aware policy needs (input lengths then are the server's count).")
    p.add_argument("--output-file", default=None, help="Append one JSON line with the config and results.")
    return p


def _model_id(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _load_tokenizer(path: str | None) -> Any:
    from servelm.model_loader.default_model import model_path_or_default
    from servelm.model_loader.tokenizer import load_tokenizer

    return load_tokenizer(model_path_or_default(path))


def main(argv: list[str] | None = None) -> int:
    """Entry point of `servelm bench serving`; returns the exit code (1 when every request failed)."""
    args = build_parser().parse_args(argv)
    model = args.model or _model_id(args.base_url, args.api_key)
    tokenizer = _load_tokenizer(args.tokenizer)
    rng = random.Random(args.seed)
    if args.dataset_name == "random":
        requests = random_dataset(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                                  args.random_range_ratio, rng)
    elif args.dataset_name == "chat":
        requests = chat_dataset(tokenizer, args.num_prompts, args.random_output_len, rng)
    elif args.dataset_name == "copy":
        requests = copy_dataset(tokenizer, args.num_prompts, args.copy_text_len, rng)
    else:
        requests = shared_prefix_dataset(tokenizer, args.gsp_num_groups, args.gsp_prompts_per_group,
                                         args.gsp_system_prompt_len, args.gsp_question_len, args.gsp_output_len, rng)
    if args.flush_cache:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        r = httpx.post(args.base_url.rstrip("/") + "/flush_cache", headers=headers, timeout=60)
        if r.status_code != 200:
            print(f"warning: /flush_cache answered {r.status_code}; the prefix cache was not flushed", file=sys.stderr)
    # Warm-up prompts are fresh random ones, so that they never seed the prefix cache being measured.
    warm = random_dataset(tokenizer, args.warmup_requests, 16, 8, 1.0, random.Random(args.seed + 1))
    if args.text_prompts:  # SMG, for one, takes no token-id prompts
        for req in warm + requests:
            req.text = tokenizer.decode(req.prompt_ids)
    before = _server_info(args.base_url, args.api_key)
    results, duration = asyncio.run(run_benchmark(
        args.base_url, model, warm + requests, args.request_rate, args.max_concurrency, args.api_key,
        args.seed, warmup=len(warm)))
    summary = summarize(results, duration)
    summary.update(speculation_delta(before, _server_info(args.base_url, args.api_key)))
    print(format_summary(summary, "Serving Benchmark Result"), flush=True)
    line = speculation_line(summary)
    if line:
        print(line, flush=True)
    if args.output_file:
        record = {**{k: v for k, v in vars(args).items() if k != "api_key"}, "model": model, **summary}
        if not math.isfinite(record["request_rate"]):
            record["request_rate"] = "inf"
        with open(args.output_file, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
    if summary["errors"]:
        print("errors: " + "; ".join(summary["errors"]), file=sys.stderr)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
