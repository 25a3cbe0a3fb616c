"""`servelm bench embeddings`: /v1/embeddings throughput at a concurrency, against sentence-transformers'
in-process `encode` on the same model (and, with `--compare-url`, another server's /v1/embeddings, such as
llama.cpp's `llama-server --embedding`), in interleaved rounds.

The inputs are `--num-inputs` sentences of `--min-len`..`--max-len` tokens (the model's tokenizer counts
them, special tokens included), made of ordinary words, the same for every contender. Each request carries
`--inputs-per-request` of them; `--concurrency` requests are in flight. Without `--base-url` the bench starts
`servelm serve` on the model itself (and stops it at the end). Reported: inputs/s and tokens/s per round, the
median of the rounds, and each contender's ratio to sentence-transformers in the same rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there been one all we their has would when if so no what up its out into can time "
         "search retrieval vector index query document answer model server embedding sentence paragraph language "
         "river mountain city garden library window morning winter summer music theatre science history").split()


def make_inputs(tokenizer: Any, count: int, min_len: int, max_len: int, seed: int = 0) -> list[str]:
    """`count` sentences whose token counts (special tokens included) are spread over [min_len, max_len]."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        target = rng.randint(min_len, max_len)
        words: list[str] = []
        while len(tokenizer(" ".join(words))["input_ids"]) < target:
            words.append(rng.choice(WORDS))
        while len(words) > 1 and len(tokenizer(" ".join(words))["input_ids"]) > target:
            words.pop()
        out.append(" ".join(words))
    return out


async def _run_server(url: str, inputs: list[str], per_request: int, concurrency: int, fmt: str,
                      client_lib: str = "aiohttp") -> float:
    """Seconds to embed all `inputs` through `url`'s /v1/embeddings."""
    chunks = [inputs[i:i + per_request] for i in range(0, len(inputs), per_request)]
    sem = asyncio.Semaphore(concurrency)
    if client_lib == "aiohttp":
        # aiohttp, as vLLM's and SGLang's serving benchmarks: the client shares this machine's cores with the
        # server, and httpx's async client took about 2.5 ms of CPU a request on two cores, as much as the
        # API process (docs/embeddings.md)
        import aiohttp

        conn = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
            async def one_aio(chunk: list[str]) -> None:
                async with sem:
                    body: dict[str, Any] = {"input": chunk if len(chunk) > 1 else chunk[0], "encoding_format": fmt}
                    async with session.post(f"{url}/v1/embeddings", json=body) as r:
                        if r.status != 200:
                            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:300]}")
                        data = (await r.json())["data"]
                    if len(data) != len(chunk):
                        raise RuntimeError(f"{url}: {len(data)} embeddings for {len(chunk)} inputs")

            await one_aio(chunks[0])  # warm the connection and the server
            start = time.perf_counter()
            await asyncio.gather(*(one_aio(c) for c in chunks))
            return time.perf_counter() - start
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def one(chunk: list[str]) -> None:
            async with sem:
                body: dict[str, Any] = {"input": chunk if len(chunk) > 1 else chunk[0], "encoding_format": fmt}
                r = await client.post(f"{url}/v1/embeddings", json=body)
                if r.status_code != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
                if len(r.json()["data"]) != len(chunk):
                    raise RuntimeError(f"{url}: {len(r.json()['data'])} embeddings for {len(chunk)} inputs")

        await one(chunks[0])  # warm the connection and the server
        start = time.perf_counter()
        await asyncio.gather(*(one(c) for c in chunks))
        return time.perf_counter() - start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_server(model_path: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "servelm", "serve", "--model-path", model_path, "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"servelm serve exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("servelm serve did not become ready in 300 s")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="servelm bench embeddings", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True, help="The embedding model (a sentence-transformers folder).")
    p.add_argument("--base-url", help="A running servelm server; default: start one on --model-path.")
    p.add_argument("--server-args", default="", help="Extra flags for the servelm server this bench starts.")
    p.add_argument("--compare-url", action="append", default=[], metavar="URL",
                   help="Another server's /v1/embeddings to measure in the same rounds (repeatable).")
    p.add_argument("--num-inputs", type=int, default=1000)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--inputs-per-request", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--encoding-format", default="base64", choices=["base64", "float"],
                   help="What the requests ask for (the openai SDK asks for base64 unless told otherwise).")
    p.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' encode batch size.")
    p.add_argument("--no-baseline", action="store_true", help="Skip sentence-transformers.")
    p.add_argument("--offline", action="store_true",
                   help="servelm in this process (Engine.embed, all inputs at once) instead of over HTTP.")
    p.add_argument("--dtype", default="auto", help="With --offline: the engine's --dtype.")
    p.add_argument("--quantization", default="auto",
                   help="With --offline: the engine's --quantization (over HTTP: pass it in --server-args).")
    p.add_argument("--client", default="aiohttp", choices=["aiohttp", "httpx"],
                   help="The HTTP client library of the requests (it shares the machine's CPU with the servers).")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.num_inputs < 1 or args.rounds < 1 or not 1 <= args.min_len <= args.max_len:
        print("Error: --num-inputs and --rounds must be >= 1 and 1 <= --min-len <= --max-len", file=sys.stderr)
        return 2

    import logging

    import torch
    import transformers

    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_path)
    inputs = make_inputs(tokenizer, args.num_inputs, args.min_len, args.max_len, args.seed)
    tokens = sum(len(tokenizer(t)["input_ids"]) for t in inputs)
    encoder = None
    if not args.no_baseline:
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError:
            print("Error: the baseline needs sentence-transformers (pip install sentence-transformers), or pass "
                  "--no-baseline", file=sys.stderr)
            return 2
        encoder = SentenceTransformer(args.model_path, device="cpu")
        encoder.encode(inputs[:args.st_batch_size], batch_size=args.st_batch_size, show_progress_bar=False)  # warm
    proc = None
    url = args.base_url
    engine = None
    if args.offline:
        from servelm.entrypoints.engine import Engine

        engine = Engine(model_path=args.model_path, dtype=args.dtype, quantization=args.quantization)
        engine.embed(inputs[:32])  # warm
    elif url is None:
        proc, url = _start_server(args.model_path, args.server_args.split())
    contenders: dict[str, Any] = {"servelm": engine if engine is not None else url,
                                  **{f"compare {i + 1}": u for i, u in enumerate(args.compare_url)}}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    if encoder is not None:
        times["sentence-transformers"] = []
    try:
        print(f"{args.num_inputs} inputs of {args.min_len}-{args.max_len} tokens ({tokens} tokens), "
              + ("servelm offline (Engine.embed); " if engine is not None else
                 f"{args.inputs_per_request} per request, concurrency {args.concurrency}; ") +
              f"sentence-transformers encode(batch_size={args.st_batch_size})")
        for r in range(args.rounds):
            for name, target in contenders.items():
                if not isinstance(target, str):  # the offline engine
                    start = time.perf_counter()
                    target.embed(inputs)
                    times[name].append(time.perf_counter() - start)
                    continue
                times[name].append(asyncio.run(_run_server(target, inputs, args.inputs_per_request,
                                                           args.concurrency, args.encoding_format, args.client)))
            if encoder is not None:
                start = time.perf_counter()
                encoder.encode(inputs, batch_size=args.st_batch_size, show_progress_bar=False)
                times["sentence-transformers"].append(time.perf_counter() - start)
            print(f"round {r + 1}: " + ", ".join(f"{n} {args.num_inputs / ts[-1]:.1f} inputs/s"
                                                 for n, ts in times.items()))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        if engine is not None:
            engine.shutdown()
    print(f"\n{'contender':<24}{'inputs/s':>10}{'tokens/s':>10}{'x ST':>8}   (medians of {args.rounds} rounds)")
    base = statistics.median(times["sentence-transformers"]) if encoder is not None else None
    for name, ts in times.items():
        t = statistics.median(ts)
        ratios = [b / x for x, b in zip(ts, times["sentence-transformers"], strict=True)] if base else []
        ratio = f"x{statistics.median(ratios):.2f}" if ratios else "-"
        print(f"{name:<24}{args.num_inputs / t:>10.1f}{tokens / t:>10.0f}{ratio:>8}")
    return 0
