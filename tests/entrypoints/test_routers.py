"""servelm as a worker behind the ecosystem's routers, each the real one from PyPI (pinned in tests/tools.py):
SMG, SGLang's sgl-router and vllm-router, in front of servelm servers on loopback.

Through each: the OpenAI routes (streamed and not), SGLang's /generate, /v1/models and /flush_cache work; its
cache-aware policy finds more cached prefix tokens than its round-robin one on a shared-prefix workload; a worker
added at run time gets traffic; and a worker killed with SIGKILL is taken out while every request still
completes on the others (tests/tools.py installs each router in its own environment)."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_fixtures import GroupProcess, ServerProcess, free_port
from tests.tools import ROUTERS, install

pytestmark = pytest.mark.slow  # installs routers, starts servers

TIMEOUT = httpx.Timeout(60.0, connect=10.0)


class Router(GroupProcess):
    def __init__(self, name: str, urls: list[str], policy: str, log: Path) -> None:
        bin_dir = install(name)
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        exe = str(bin_dir / ROUTERS[name][1])
        head = {"smg": [exe, "launch"], "sglang-router": [exe, "-m", "sglang_router.launch_router"],
                "vllm-router": [exe]}[name]
        argv = [*head, "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *urls, "--policy", policy,
                "--health-check-interval-secs", "1", "--prometheus-port", str(free_port())]
        super().__init__(argv, log, {**os.environ, "NO_COLOR": "1"})

    def healthy_workers(self) -> int:
        try:
            r = httpx.get(f"{self.url}/readiness", timeout=5)
            return int(r.json().get("healthy_workers", 0)) if r.status_code == 200 else 0
        except (httpx.HTTPError, ValueError):
            return 0

    def wait_workers(self, n: int, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited:\n{self.log()[-3000:]}")
            if self.healthy_workers() >= n:
                return
            time.sleep(0.5)
        raise AssertionError(f"{self.name} has not {n} healthy workers:\n{self.log()[-3000:]}")

    def add_worker(self, url: str) -> None:
        if self.name == "vllm-router":
            r = httpx.post(f"{self.url}/add_worker", params={"url": url}, timeout=TIMEOUT)
        else:  # SMG and sgl-router: the workers API
            r = httpx.post(f"{self.url}/workers", json={"url": url}, timeout=TIMEOUT)
        assert r.status_code in (200, 202), r.text



def _workers(model: Path, tmp: Path, n: int, first: int = 0) -> list[ServerProcess]:
    servers = [ServerProcess(["--model-path", str(model), "--disable-torch-compile", "--max-total-tokens", "8192",
                              "--served-model-name", "tiny", "--num-threads", "1"], tmp / f"worker{first + i}.log")
               for i in range(n)]
    for srv in servers:
        srv.wait_ready(120)
    return servers


def _cached_tokens(router: Router, prompts: list[str]) -> int:
    total = 0
    for prompt in prompts:
        r = httpx.post(f"{router.url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2,
                                                             "temperature": 0}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        total += r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return total


def _shared_prefix_prompts() -> list[str]:
    """3 groups (odd, so that round-robin over 2 workers splits every group) of 4 questions after one long prefix,
    interleaved across the groups."""
    rng = random.Random(5)
    words = ["river", "stone", "lantern", "orchard", "copper", "meadow", "harbor", "violet", "engine", "willow"]
    prefixes = [" ".join(rng.choice(words) for _ in range(80)) for _ in range(3)]
    return [f"{prefixes[g]} Question {q}: what is {g * 10 + q}?" for q in range(4) for g in range(3)]


def _flush(workers: list[ServerProcess]) -> None:
    for w in workers:
        assert httpx.post(f"{w.base_url}/flush_cache", timeout=TIMEOUT).status_code == 200


@pytest.fixture
def cleanup() -> Iterator[list]:
    things: list = []
    yield things
    for thing in reversed(things):
        thing.stop() if isinstance(thing, Router) else thing.stop(signal.SIGKILL)


@pytest.mark.parametrize("name", list(ROUTERS))
def test_servelm_workers_behind_a_router(name: str, tiny_llama: tuple[Path, object], tmp_path: Path,
                                         cleanup: list) -> None:
    workers = _workers(tiny_llama[0], tmp_path, 2)
    cleanup.extend(workers)
    urls = [w.base_url for w in workers]
    router = Router(name, urls, "cache_aware", tmp_path / f"{name}.cache_aware.log")
    cleanup.append(router)
    router.wait_workers(2)

    # The API routes, through the router.
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", timeout=60, max_retries=0)
    done = client.completions.create(model="tiny", prompt="Hello there", max_tokens=4, temperature=0)
    assert done.choices[0].finish_reason in ("length", "stop") and done.usage.completion_tokens >= 1
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=4, stream=True)
    assert [c for c in stream if c.choices and c.choices[0].finish_reason]
    for streamed in (False, True):
        r = httpx.post(f"{router.url}/generate", timeout=TIMEOUT, json={
            "text": "Once upon", "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "stream": streamed})
        assert r.status_code == 200, r.text
        assert ("data: [DONE]" in r.text) if streamed else r.json()["meta_info"]["completion_tokens"] == 4
    models = httpx.get(f"{router.url}/v1/models", timeout=TIMEOUT).json()
    assert "tiny" in json.dumps(models) or name == "sglang-router" and models["data"]
    assert httpx.post(f"{router.url}/flush_cache", timeout=TIMEOUT).status_code == 200

    # Cache-aware beats round-robin on shared prefixes (each measured from empty caches).
    prompts = _shared_prefix_prompts()
    _flush(workers)
    cache_aware = _cached_tokens(router, prompts)
    rr = Router(name, urls, "round_robin", tmp_path / f"{name}.round_robin.log")
    cleanup.append(rr)
    rr.wait_workers(2)
    _flush(workers)
    round_robin = _cached_tokens(rr, prompts)
    assert cache_aware > round_robin > 0, (cache_aware, round_robin)

    # A worker added at run time gets its turn (round-robin: a cache-aware policy may well keep new prompts on
    # the workers it knows).
    (third,) = _workers(tiny_llama[0], tmp_path, 1, first=2)
    cleanup.append(third)
    rr.add_worker(third.base_url)
    rr.wait_workers(3)
    _cached_tokens(rr, [f"A new topic number {i}" for i in range(6)])
    info = httpx.get(f"{third.base_url}/server_info", timeout=TIMEOUT).json()
    assert info["cache_query_tokens"] > 0, rr.log()[-3000:]

    # A worker killed with SIGKILL: every request still completes (retried on the other), and the router takes
    # the dead one out.
    ok = 0
    for i in range(12):
        if i == 4:
            for proc in [*workers[0].children(), workers[0].proc]:  # the server and its scheduler: the whole host
                proc.kill()
        r = httpx.post(f"{rr.url}/v1/completions", json={"model": "tiny", "prompt": f"Item {i}", "max_tokens": 4},
                       timeout=TIMEOUT)
        ok += r.status_code == 200
    assert ok == 12, rr.log()[-3000:]
    deadline = time.monotonic() + 60
    while rr.healthy_workers() != 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert rr.healthy_workers() == 2, rr.log()[-3000:]
