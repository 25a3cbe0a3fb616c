"""`servelm bench images`: images/s and seconds per denoising step of the diffusion server at a given
concurrency, against the plain in-process diffusers pipeline called one request at a time, in the same run.

Without --base-url the server is started here (`servelm serve --model-type diffusion MODEL`, batch size =
--concurrency) after the baseline has run and been freed, and stopped at the end. Both sides denoise the same
requests: --num-requests prompts, --steps steps, --size, one image each, seeds 0..N-1. Seconds per step: the
baseline's from the pipeline's step-end callback, the server's from its /metrics (a step of a batch).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="servelm bench images", description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True, help="A local diffusers folder.")
    parser.add_argument("--base-url", default=None, help="A running diffusion server (default: start one here).")
    parser.add_argument("--api-key", default=None, help="Its API key, if it needs one.")
    parser.add_argument("--concurrency", type=int, default=4, help="Requests in flight at the server (default 4).")
    parser.add_argument("--num-requests", type=int, default=16, help="Requests on each side (default 16).")
    parser.add_argument("--steps", type=int, default=4, help="Denoising steps per image (default 4).")
    parser.add_argument("--size", default="64x64", help="WIDTHxHEIGHT (default 64x64).")
    parser.add_argument("--guidance-scale", type=float, default=None, help="Default: the pipeline's.")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="CPU threads of both sides (default: each its own default; the server adapts).")
    parser.add_argument("--batch-wait-ms", type=float, default=None,
                        help="The started server's --batch-wait-ms (default: the server's default).")
    parser.add_argument("--baseline", choices=["diffusers", "none"], default="diffusers")
    parser.add_argument("--json", default=None, help="Append the results as one JSON line to this file.")
    return parser


def prompt(i: int) -> str:
    return f"a photo of object number {i} on a table"


# ------------------------------------------------------------------ baseline
def run_baseline(ns: argparse.Namespace, width: int, height: int) -> dict[str, float]:
    """The plain diffusers pipeline, one request at a time (after one warm-up call)."""
    import torch
    from diffusers import DiffusionPipeline

    if ns.num_threads:
        torch.set_num_threads(ns.num_threads)
    pipe = DiffusionPipeline.from_pretrained(ns.model_path)
    pipe.set_progress_bar_config(disable=True)
    extra = {} if ns.guidance_scale is None else {"guidance_scale": ns.guidance_scale}
    steps: list[float] = []
    last = [0.0]

    def step_end(_pipe: Any, _i: int, _t: Any, _kw: dict[str, Any]) -> dict[str, Any]:
        now = time.perf_counter()
        steps.append(now - last[0])
        last[0] = now
        return {}

    def one(i: int) -> None:
        last[0] = time.perf_counter()
        pipe(prompt(i), num_inference_steps=ns.steps, width=width, height=height, callback_on_step_end=step_end,
             generator=torch.Generator().manual_seed(i), **extra)

    one(0)  # warm-up
    steps.clear()
    started = time.perf_counter()
    for i in range(ns.num_requests):
        one(i)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "images_per_s": ns.num_requests / seconds, "s_per_step": sum(steps) / len(steps)}


# ------------------------------------------------------------------ server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def diffusion_server(ns: argparse.Namespace) -> Iterator[str]:
    """The base URL of --base-url, or of a server started here for the run (stopped on the way out)."""
    if ns.base_url:
        yield ns.base_url.rstrip("/")
        return
    port = _free_port()
    cmd = [sys.executable, "-m", "servelm", "serve", "--model-type", "diffusion", ns.model_path, "--port", str(port),
           "--max-batch-size", str(ns.concurrency), "--max-queued-requests", str(max(ns.num_requests, 1)),
           "--log-level", "warning"]
    if ns.num_threads:
        cmd += ["--num-threads", str(ns.num_threads)]
    if ns.batch_wait_ms is not None:
        cmd += ["--batch-wait-ms", str(ns.batch_wait_ms)]
    if ns.api_key:
        cmd += ["--api-key", ns.api_key]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the diffusion server exited with code {proc.returncode}: {' '.join(cmd)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the diffusion server did not start within 600 s")
            time.sleep(0.3)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^servelm:{name}{{[^}}]*}} (\S+)$", text, re.MULTILINE))


async def _load(url: str, ns: argparse.Namespace, headers: dict[str, str]) -> float:
    """Wall seconds of --num-requests requests, --concurrency at a time."""
    body = {"size": ns.size, "num_inference_steps": ns.steps, "response_format": "b64_json"}
    if ns.guidance_scale is not None:
        body["guidance_scale"] = ns.guidance_scale
    limit = asyncio.Semaphore(ns.concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=3600) as http:
        async def one(i: int) -> None:
            async with limit:
                r = await http.post("/v1/images/generations", json={**body, "prompt": prompt(i), "seed": i})
                r.raise_for_status()

        await one(0)  # warm-up
        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(ns.num_requests)))
        return time.perf_counter() - started


def run_server(ns: argparse.Namespace) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    with diffusion_server(ns) as url:
        before = httpx.get(f"{url}/metrics", timeout=30).text
        seconds = asyncio.run(_load(url, ns, headers))
        after = httpx.get(f"{url}/metrics", timeout=30).text
    delta = {name: _metric(after, name) - _metric(before, name) for name in (
        "denoising_step_seconds_sum", "denoising_step_seconds_count", "batch_size_images_sum",
        "batch_size_images_count")}
    return {"seconds": seconds, "images_per_s": ns.num_requests / seconds,
            "s_per_step": delta["denoising_step_seconds_sum"] / max(delta["denoising_step_seconds_count"], 1),
            # The warm-up request is in the metrics' delta too.
            "mean_batch_images": delta["batch_size_images_sum"] / max(delta["batch_size_images_count"], 1)}


def main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise here
    from servelm.diffusion.protocol import parse_size

    width, height = parse_size(ns.size, (0, 0), 1 << 16)
    print(f"model {ns.model_path}  {ns.num_requests} requests  {ns.steps} steps  {width}x{height}  "
          f"concurrency {ns.concurrency}  threads {ns.num_threads or 'default'}", flush=True)
    results: dict[str, Any] = {"bench": "images", **{k: v for k, v in vars(ns).items() if k != "api_key"}}
    if ns.baseline == "diffusers":
        base = run_baseline(ns, width, height)
        gc.collect()  # the baseline's pipeline is gone before the server loads its own
        results["baseline"] = base
        print(f"diffusers, one at a time : {base['images_per_s']:7.2f} images/s  {base['s_per_step'] * 1e3:8.1f} "
              f"ms/step  ({base['seconds']:.1f} s)", flush=True)
    served = run_server(ns)
    results["server"] = served
    print(f"servelm, concurrency {ns.concurrency:<3d} : {served['images_per_s']:7.2f} images/s  "
          f"{served['s_per_step'] * 1e3:8.1f} ms/step of a batch  ({served['seconds']:.1f} s, "
          f"mean batch {served['mean_batch_images']:.1f} images)", flush=True)
    if ns.baseline == "diffusers":
        results["ratio"] = served["images_per_s"] / results["baseline"]["images_per_s"]
        print(f"ratio servelm / diffusers: x{results['ratio']:.2f} images/s")
    if ns.json:
        with open(ns.json, "a") as fh:
            fh.write(json.dumps(results) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main(sys.argv[1:]))
