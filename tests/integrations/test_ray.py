"""servelm on a local Ray cluster: a Ray Serve deployment of servelm replicas answers the openai client as a
servelm server does (streams and errors included), scales out on requests in flight and back in, and leaves no
process behind."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.server_fixtures import STEP_DELAY_ENV, free_port

pytestmark = pytest.mark.slow  # starts a Ray cluster and servers

ray = pytest.importorskip("ray", reason="ray[serve] is a test dependency (pip install -e '.[test]')")
serve = pytest.importorskip("ray.serve")

from servelm.integrations.ray import deployment  # noqa: E402


def _servelm_processes() -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "servelm serve" in cmd and "--host 127.0.0.1" in cmd:
            out.append(p)
    return out


@pytest.fixture(scope="module")
def serve_url() -> Iterator[str]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
    deadline = time.monotonic() + 30
    while _servelm_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _servelm_processes()


def _args(model: Path) -> dict:
    return {"model_path": str(model), "disable_torch_compile": True, "max_total_tokens": 2048,
            "served_model_name": "tiny"}


def test_a_serve_deployment_answers_as_a_servelm_server(serve_url: str, tiny_llama: tuple[Path, object]) -> None:
    serve.run(deployment(_args(tiny_llama[0]), num_replicas=1), name="servelm", route_prefix="/")
    client = openai.OpenAI(base_url=f"{serve_url}/v1", api_key="x", timeout=60, max_retries=0)
    done = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=6, temperature=0)
    assert done.usage.completion_tokens == 6 and done.choices[0].text
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=5, stream=True, temperature=0))
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    r = httpx.post(f"{serve_url}/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 6, "temperature": 0}}, timeout=60)
    assert r.status_code == 200 and r.json()["output_ids"]
    # Errors come back as servelm sends them: status and OpenAI's error shape.
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="x", max_tokens=-1)
    assert httpx.get(f"{serve_url}/v1/models", timeout=30).json()["data"][0]["id"] == "tiny"
    serve.delete("servelm")


def _running_replicas() -> int:
    app = serve.status().applications.get("servelm")
    if app is None:
        return 0
    return sum(d.replica_states.get("RUNNING", 0) for d in app.deployments.values())


def test_replicas_scale_out_on_requests_in_flight_and_back(serve_url: str, tiny_llama: tuple[Path, object]) -> None:
    env = {"SERVELM_SCHEDULER_FACTORY": "tests.server_fixtures:slow_step_scheduler", STEP_DELAY_ENV: "0.1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    # Ray Serve's metrics are pushed every metrics_interval_s (10 s by default) and a new replica takes
    # seconds to start a servelm server, so on a slow machine one wave of requests can end before the
    # second replica runs: the load goes on, wave after wave, until it does (or the deadline).
    serve.run(deployment(_args(tiny_llama[0]), env=env, autoscaling_config={
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 0,
        "downscale_delay_s": 2, "metrics_interval_s": 0.5, "look_back_period_s": 2}),
        name="servelm", route_prefix="/")
    assert _running_replicas() == 1

    async def wave(client: httpx.AsyncClient) -> list[int]:
        async def one(i: int) -> int:
            r = await client.post(f"{serve_url}/v1/completions", json={
                "model": "tiny", "prompt": [i + 3, 9], "max_tokens": 150, "ignore_eos": True})
            return r.status_code
        return await asyncio.gather(*(one(i) for i in range(4)))

    seen: list[int] = []
    statuses: list[int] = []

    async def watch_and_load() -> None:
        deadline = time.monotonic() + 240
        async with httpx.AsyncClient(timeout=180) as client:
            while time.monotonic() < deadline and max(seen, default=0) < 2:
                task = asyncio.ensure_future(wave(client))
                while not task.done():
                    seen.append(_running_replicas())
                    await asyncio.sleep(0.5)
                statuses.extend(await task)

    asyncio.run(watch_and_load())
    assert statuses and set(statuses) == {200}, statuses
    assert max(seen) == 2, seen
    deadline = time.monotonic() + 90
    while _running_replicas() != 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _running_replicas() == 1
    serve.delete("servelm")
