"""The diffusion server, served for real from the tiny pipeline folder: OpenAI Images API over HTTP."""

from __future__ import annotations

import asyncio
import base64
import io
import re
import signal
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.server_fixtures import ServerProcess, start_server

pytestmark = pytest.mark.slow  # starts servers, spawns ranks or loads the default model

KEY = "sk-diffusion-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
FAST = {"num_inference_steps": 3}
LONG_STEPS = 400  # a request that outlasts every test's patience: it is always hung up


@pytest.fixture(scope="module")
def server(tiny_sd: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # No --model-type: auto-detection must pick the diffusion backend for a diffusers folder.
    srv = start_server([str(tiny_sd), "--api-key", KEY, "--max-queued-requests", "4", "--max-batch-size", "8",
                        "--max-image-size", "64", "--served-model-name", "tiny-sd", "--shutdown-timeout", "1"],
                       tmp_path_factory.mktemp("logs") / "diffusion.log", timeout=300)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_sd: Path) -> Any:
    """The same folder loaded by diffusers in this process: what the server must reproduce."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(tiny_sd)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.int16)


def generate(server: ServerProcess, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/images/generations", json={"model": "tiny-sd", **body}, headers=AUTH,
                      timeout=120)


def metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^servelm:{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text,
                                                      re.MULTILINE))


def wait_metric(server: ServerProcess, name: str, value: float, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while metric(server, name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}: {metric(server, name)}"
        time.sleep(0.05)


async def await_metric(server: ServerProcess, name: str, value: float, timeout: float = 60) -> None:
    await asyncio.to_thread(wait_metric, server, name, value, timeout)


@asynccontextmanager
async def pipeline_busy(server: ServerProcess, http: httpx.AsyncClient) -> AsyncIterator[asyncio.Task[Any]]:
    """A long request holds the pipeline (so that what comes next queues up); hung up on the way out."""
    task = asyncio.create_task(http.post("/v1/images/generations", json={
        "prompt": "blocker", "size": "32x32", "num_inference_steps": LONG_STEPS}))
    await await_metric(server, "num_requests_running", 1)
    try:
        yield task
    finally:
        task.cancel()  # closes its connection: the server sees the hang-up
        await asyncio.gather(task, return_exceptions=True)


def in_process(pipe: Any, prompt: str, seed: int, steps: int, size: tuple[int, int] = (32, 32),
               guidance: float = 7.5) -> np.ndarray:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared: one thread is the fast choice (and any count must agree)
    try:
        image = pipe(prompt, generator=torch.Generator().manual_seed(seed), num_inference_steps=steps,
                     width=size[0], height=size[1], guidance_scale=guidance).images[0]
    finally:
        torch.set_num_threads(threads)
    return np.asarray(image, dtype=np.int16)


# ---------------------------------------------------------------- OpenAI client
def test_auto_detection_picked_the_diffusion_backend(server: ServerProcess) -> None:
    assert "Serve backend: diffusion (auto-detected)" in server.log()


def test_openai_client_generate_n_images_of_the_requested_size(client: openai.OpenAI) -> None:
    result = client.images.generate(model="tiny-sd", prompt="a small red house", n=2, size="48x32",
                                    response_format="b64_json", extra_body={"seed": 5, **FAST})
    assert len(result.data) == 2 and result.created > 0
    images = [decode(d.b64_json) for d in result.data]
    assert all(img.shape == (32, 48, 3) for img in images)
    assert not np.array_equal(images[0], images[1])  # image i has seed + i


def test_default_size_is_the_pipelines(client: openai.OpenAI) -> None:
    result = client.images.generate(model="tiny-sd", prompt="a boat", extra_body={"num_inference_steps": 2})
    assert decode(result.data[0].b64_json).shape == (32, 32, 3)


def test_server_image_equals_in_process_diffusers(client: openai.OpenAI, reference: Any) -> None:
    result = client.images.generate(model="tiny-sd", prompt="a lighthouse at dusk", size="32x32",
                                    extra_body={"seed": 11, "num_inference_steps": 4, "guidance_scale": 5.0})
    served = decode(result.data[0].b64_json)
    expected = in_process(reference, "a lighthouse at dusk", seed=11, steps=4, guidance=5.0)
    assert np.abs(served - expected).max() <= 1


def test_different_seeds_differ_same_seed_repeats(server: ServerProcess) -> None:
    a, b, c = (generate(server, prompt="a tree", size="32x32", seed=s, **FAST).json()["data"][0]["b64_json"]
               for s in (1, 2, 1))
    assert not np.array_equal(decode(a), decode(b))
    assert np.abs(decode(a) - decode(c)).max() <= 1


def test_seed_gives_the_same_image_alone_and_in_a_batch_of_four(server: ServerProcess) -> None:
    body = {"prompt": "a blue bird on a wire", "size": "32x32", "seed": 42, **FAST}
    alone = decode(generate(server, **body).json()["data"][0]["b64_json"])
    others = [{"prompt": "a mountain", "size": "32x32", "seed": 7, **FAST},
              {"prompt": "a river", "size": "32x32", "seed": 42, "n": 2, **FAST},
              {"prompt": "a city at night", "size": "32x32", **FAST}]
    batches_before, images_before = metric(server, "batch_size_images_count"), metric(server, "batch_size_images_sum")

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=120) as http:
            async with pipeline_busy(server, http):
                tasks = [asyncio.create_task(http.post("/v1/images/generations", json=b)) for b in [body, *others]]
                await await_metric(server, "num_requests_waiting", 4)
            return await asyncio.gather(*tasks)

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 4
    batched = decode(responses[0].json()["data"][0]["b64_json"])
    assert np.abs(batched - alone).max() <= 1
    assert len(responses[2].json()["data"]) == 2
    # One batch of the blocker (1 image) and one of the four requests (5 images).
    assert metric(server, "batch_size_images_count") - batches_before == 2
    assert metric(server, "batch_size_images_sum") - images_before == 6
    assert "Denoising a batch of 5 image(s) from 4 request(s)" in server.log()


def test_openai_client_edit_with_url_result(client: openai.OpenAI, server: ServerProcess) -> None:
    source = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 40, 3), dtype=np.uint8))
    buf = io.BytesIO()
    source.save(buf, format="PNG")
    result = client.images.edit(image=("in.png", buf.getvalue(), "image/png"), prompt="make it blue", n=2,
                                size="32x32", response_format="url", extra_body={"seed": 3, "num_inference_steps": 4})
    assert len(result.data) == 2
    for item in result.data:
        assert item.url.startswith(server.base_url + "/v1/images/img-")
        png = httpx.get(item.url, headers=AUTH, timeout=10)
        assert png.status_code == 200 and png.headers["content-type"] == "image/png"
        assert Image.open(io.BytesIO(png.content)).size == (32, 32)
    again = client.images.edit(image=("in.png", buf.getvalue(), "image/png"), prompt="make it blue", size="32x32",
                               response_format="b64_json", extra_body={"seed": 3, "num_inference_steps": 4})
    first = np.asarray(Image.open(io.BytesIO(httpx.get(result.data[0].url, headers=AUTH).content)), dtype=np.int16)
    assert np.abs(decode(again.data[0].b64_json) - first).max() <= 1
    missing = httpx.get(f"{server.base_url}/v1/images/img-nope/content", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "image_id"


def test_edit_default_size_is_the_uploads_fitted_to_the_limit(server: ServerProcess) -> None:
    sizes = []
    for upload in ((40, 40), (100, 60)):
        png = io.BytesIO()
        Image.new("RGB", upload, (200, 30, 30)).save(png, format="PNG")
        r = _edit(server, {"image": ("a.png", png.getvalue(), "image/png")},
                  {"prompt": "x", "num_inference_steps": "2", "response_format": "b64_json"})
        assert r.status_code == 200, r.text
        sizes.append(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))).size)
    assert sizes == [(40, 40), (64, 32)]  # --max-image-size 64; multiples of 8


def test_models_endpoints(server: ServerProcess, tiny_sd: Path) -> None:
    models = httpx.get(f"{server.base_url}/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == ["tiny-sd"]
    info = httpx.get(f"{server.base_url}/models", headers=AUTH).json()
    assert info["model_path"] == str(tiny_sd) and info["pipeline_class"] == "StableDiffusionPipeline"
    assert (info["task_type"], info["dtype"], info["device"]) == ("text-to-image", "float32", "cpu")


def test_api_key_required(server: ServerProcess) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{server.base_url}/v1/images/generations", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # probes need no key
    assert "servelm:images_generated_total" in httpx.get(f"{server.base_url}/metrics").text


# ---------------------------------------------------------------- scheduling
def test_hang_up_stops_the_denoising_loop_early(server: ServerProcess) -> None:
    steps_before, aborted_before = metric(server, "denoising_step_seconds_count"), _aborted(server)

    async def hang_up() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=120) as http:
            async with pipeline_busy(server, http):
                await asyncio.to_thread(wait_steps, server, steps_before + 2)

    asyncio.run(hang_up())
    wait_metric(server, "num_requests_running", 0)
    assert _aborted(server) == aborted_before + 1
    done = metric(server, "denoising_step_seconds_count") - steps_before
    assert 2 <= done < LONG_STEPS
    assert re.search(rf"Stopped a batch of 1 request\(s\) after \d+ of {LONG_STEPS} denoising step", server.log())
    assert generate(server, prompt="still serving", size="32x32", **FAST).status_code == 200


def _aborted(server: ServerProcess) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    match = re.search(r'^servelm:num_requests_total{model_name="tiny-sd",outcome="aborted"} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def wait_steps(server: ServerProcess, count: float) -> None:
    deadline = time.monotonic() + 60
    while metric(server, "denoising_step_seconds_count") < count:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_full_queue_gets_429_with_retry_after(server: ServerProcess) -> None:
    async def overflow() -> httpx.Response:
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=120) as http:
            async with pipeline_busy(server, http):
                body = {"prompt": "queued", "size": "32x32", "num_inference_steps": LONG_STEPS}
                queued = [asyncio.create_task(http.post("/v1/images/generations", json=body)) for _ in range(4)]
                await await_metric(server, "num_requests_waiting", 4)
                refused = await http.post("/v1/images/generations", json={"prompt": "one too many", **FAST})
                for task in queued:
                    task.cancel()
                await asyncio.gather(*queued, return_exceptions=True)
            return refused

    refused = asyncio.run(overflow())
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "queue_full"
    wait_metric(server, "num_requests_waiting", 0)
    wait_metric(server, "num_requests_running", 0)
    assert metric(server, "num_rejected_requests_total") >= 1
    assert generate(server, prompt="still serving", size="32x32", **FAST).status_code == 200


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(("body", "param", "text"), [
    ({"prompt": ""}, "prompt", "must not be empty"),
    ({"prompt": "   "}, "prompt", "must not be empty"),
    ({"prompt": "x" * 4001}, "prompt", "at most 4000 characters"),
    ({"prompt": 123}, "prompt", "valid string"),
    ({}, "prompt", "required"),
    ({"prompt": "x", "size": "31x32"}, "size", "multiples of 8"),
    ({"prompt": "x", "size": "128x128"}, "size", "[8, 64]"),
    ({"prompt": "x", "size": "big"}, "size", "WIDTHxHEIGHT"),
    ({"prompt": "x", "n": 0}, "n", "greater than or equal to 1"),
    ({"prompt": "x", "n": 11}, "n", "less than or equal to 10"),
    ({"prompt": "x", "n": "two"}, "n", "valid integer"),
    ({"prompt": "x", "response_format": "url"}, "response_format", "'url' is not supported"),
    ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps", "greater than or equal to 1"),
    ({"prompt": "x", "num_inference_steps": 501}, "num_inference_steps", "at most 500"),
    ({"prompt": "x", "guidance_scale": "high"}, "guidance_scale", "valid number"),
    ({"prompt": "x", "seed": -1}, "seed", "greater than or equal to 0"),
    ({"prompt": "x", "quality": "hd"}, "quality", "Unrecognized request argument"),
])
def test_bad_generation_requests_are_400(server: ServerProcess, body: dict[str, Any], param: str, text: str) -> None:
    r = httpx.post(f"{server.base_url}/v1/images/generations", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and text in error["message"], error


def test_unknown_model_is_404(server: ServerProcess) -> None:
    r = generate(server, prompt="x", model="other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def _edit(server: ServerProcess, files: Any, data: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/images/edits", files=files, data=data, headers=AUTH, timeout=30)


def test_bad_edits_are_400(server: ServerProcess) -> None:
    png = io.BytesIO()
    Image.new("RGB", (32, 32)).save(png, format="PNG")
    cases = [
        (_edit(server, {"image": ("a.txt", b"not an image", "text/plain")}, {"prompt": "x"}), "image", "not an image"),
        (_edit(server, {"other": ("a.png", png.getvalue(), "image/png")}, {"prompt": "x"}), "image", "required"),
        (_edit(server, {"image": ("a.png", png.getvalue(), "image/png"), "mask": ("m.png", png.getvalue())},
               {"prompt": "x"}), "mask", "not supported"),
        (_edit(server, {"image": ("a.png", png.getvalue(), "image/png")}, {"prompt": "x", "n": "many"}), "n",
         "valid integer"),
        (_edit(server, {"image": ("a.png", png.getvalue(), "image/png")}, {"prompt": ""}), "prompt", "empty"),
        (_edit(server, {"image": ("a.png", png.getvalue(), "image/png")}, {"prompt": "x", "size": "30x30"}), "size",
         "multiples of 8"),
        (_edit(server, {"image": ("a.png", png.getvalue(), "image/png")}, {"prompt": "x", "quality": "hd"}),
         "quality", "Unrecognized request argument supplied: quality"),
        (_edit(server, {"image": ("a.png", png.getvalue(), "image/png")},  # 1 step x 0.8 strength: no step at all
               {"prompt": "x", "num_inference_steps": "1"}), "strength", "must be at least 1"),
        (httpx.post(f"{server.base_url}/v1/images/edits", json={"prompt": "x"}, headers=AUTH), "body", "multipart"),
    ]
    for response, param, text in cases:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and text in error["message"], error
    assert httpx.get(f"{server.base_url}/health").status_code == 200


# ---------------------------------------------------------------- benchmark
def test_bench_images_against_the_running_server(server: ServerProcess, tiny_sd: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from servelm.bench.images import main as bench_main

    out = tmp_path / "bench.jsonl"
    assert bench_main(["--model-path", str(tiny_sd), "--base-url", server.base_url, "--api-key", KEY,
                       "--concurrency", "4", "--num-requests", "4", "--steps", "2", "--size", "32x32",
                       "--num-threads", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "diffusers, one at a time" in text and "servelm, concurrency 4" in text and "ratio" in text
    result = json.loads(out.read_text())
    for side in ("baseline", "server"):
        assert result[side]["images_per_s"] > 0 and result[side]["s_per_step"] > 0
    assert result["server"]["mean_batch_images"] >= 1 and result["ratio"] > 0


# ---------------------------------------------------------------- stopping (last: it stops the module's server)
def test_sigterm_ends_a_running_request_with_503_then_exits_0(server: ServerProcess) -> None:
    async def stop_while_running() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=120) as http:
            running = asyncio.create_task(http.post("/v1/images/generations", json={
                "prompt": "interrupted", "size": "32x32", "num_inference_steps": LONG_STEPS}))
            await await_metric(server, "num_requests_running", 1)
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            refused = await http.post("/v1/images/generations", json={"prompt": "too late", **FAST})
            return await running, refused

    running, refused = asyncio.run(stop_while_running())
    assert refused.status_code == 503 and refused.json()["error"]["message"] == "The server is shutting down"
    assert running.status_code == 503 and running.json()["error"]["message"] == "The server is shutting down"
    assert server.proc.wait(30) == 0
