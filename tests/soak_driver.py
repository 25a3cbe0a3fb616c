"""A bounded soak of a running server: mixed requests (stream or not, n > 1, logprobs, structured output,
prompt logprobs), a share of clients that hang up mid-request, a fixed seed so every run sends the same mix.

Used by tests/entrypoints/test_server_soak.py; run it by hand for a longer soak and the scheduler's memory:
    python -m tests.soak_driver --base-url http://127.0.0.1:30000 --requests 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections import Counter
from typing import Any

import httpx

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "far", "away", "from", "home", "story"]


def make_request(rng: random.Random, model: str) -> tuple[str, dict[str, Any], bool]:
    """(path, body, hang up?) of one request of the mix."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    kind = rng.choice(["chat", "completion", "generate"])
    stream = rng.random() < 0.5
    hang_up = rng.random() < 0.2
    max_tokens = rng.randint(1, 24)
    common: dict[str, Any] = {"temperature": rng.choice([0.0, 0.8]), "seed": rng.randint(0, 10), "stream": stream}
    if kind == "generate":
        params: dict[str, Any] = {"max_new_tokens": max_tokens, "temperature": common["temperature"]}
        if rng.random() < 0.2:
            params["prompt_logprobs"] = True
        if rng.random() < 0.2:
            params["n"] = rng.randint(2, 3)
        return "/generate", {"text": prompt, "sampling_params": params, "stream": stream}, hang_up
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "n": rng.choice([1, 1, 1, 2, 3]), **common}
    if rng.random() < 0.3:
        body["logprobs"] = True if kind == "chat" else rng.randint(0, 3)
        if kind == "chat":
            body["top_logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.15:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
        body["max_tokens"] = 40
    if kind == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}, hang_up
    if rng.random() < 0.1 and "logprobs" in body:
        body["echo"] = True
    return "/v1/completions", {**body, "prompt": prompt}, hang_up


async def one(client: httpx.AsyncClient, path: str, body: dict[str, Any], hang_up: bool, rng: random.Random,
              stats: Counter) -> None:
    try:
        if body.get("stream"):
            async with client.stream("POST", path, json=body) as resp:
                stats[f"status {resp.status_code}"] += 1
                chunks = 0
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        chunks += 1
                        if line != "data: [DONE]" and "error" in json.loads(line[6:]):
                            stats["stream error event"] += 1
                        if hang_up and chunks >= 2:
                            stats["hung up"] += 1
                            return  # leaving the block closes the connection mid-stream
        else:
            timeout = rng.uniform(0.01, 0.2) if hang_up else 120
            resp = await client.post(path, json=body, timeout=timeout)
            stats[f"status {resp.status_code}"] += 1
    except httpx.TimeoutException:
        stats["hung up"] += 1


async def soak(base_url: str, requests: int, concurrency: int = 8, seed: int = 0, model: str = "tiny") -> Counter:
    """Send `requests` requests of the mix, `concurrency` at a time; returns counts of what happened."""
    rng = random.Random(seed)
    plan = [make_request(rng, model) for _ in range(requests)]
    stats: Counter = Counter()
    queue: asyncio.Queue = asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)

    async def worker(k: int) -> None:
        wrng = random.Random(seed * 1000 + k)
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            while not queue.empty():
                path, body, hang_up = queue.get_nowait()
                await one(client, path, body, hang_up, wrng, stats)

    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    print(dict(asyncio.run(soak(args.base_url, args.requests, args.concurrency, model=args.model))))


if __name__ == "__main__":
    main()
