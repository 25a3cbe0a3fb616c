"""servelm on Ray Serve: every Serve replica runs one servelm server, and Serve's proxy spreads the requests over
them and scales them with the load.

Each replica starts `servelm serve` on a free loopback port as a child that dies with the replica's actor
(however the actor dies), waits for /health, and then forwards every HTTP request to it unchanged: the OpenAI
routes, SGLang's native ones, streams (server-sent events go through as they come), errors. So a Ray Serve
deployment answers exactly what a servelm server answers. The model, its scheduler and its KV cache stay in
servelm's own processes.

A child server, rather than servelm's app inside the actor, because servelm's server owns processes (the
scheduler, TP ranks) and their lifetimes, which an actor's event loop should not.

Scaling follows Serve's queue-length signal: the requests in flight per replica (`target_ongoing_requests`).
The replica's CPUs are `ray_actor_options["num_cpus"]`, and the server gets as many threads.

    from ray import serve
    from servelm.integrations.ray import deployment
    serve.run(deployment({"model_path": "/models/m.gguf"}, autoscaling_config={
        "min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16}), route_prefix="/")

or from the command line: `serve run servelm.integrations.ray:build_app model_path=/models/m.gguf num_replicas=2`.

Needs `ray[serve]` (`pip install 'servelm[ray]'`); plain `ray[serve]`, not `ray[llm]`, which pulls in vLLM.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

START_TIMEOUT_S = 600.0
# Request headers that describe the hop, not the request (the child gets its own).
_HOP_HEADERS = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # in the child, before exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def server_argv(server_args: dict[str, Any], port: int, num_threads: int | None) -> list[str]:
    """`servelm serve` with these flags (ServerArgs field names, e.g. {"model_path": ..., "tp_size": 2}; True
    for a switch), on 127.0.0.1:`port`."""
    argv = [sys.executable, "-m", "servelm", "serve"]
    for name, value in server_args.items():
        if name in ("host", "port") or value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    if num_threads and "num_threads" not in server_args:
        argv += ["--num-threads", str(num_threads)]
    return [*argv, "--host", "127.0.0.1", "--port", str(port)]


class ServelmServer:
    """One Serve replica: a servelm server in a child process, and a proxy to it."""

    def __init__(self, server_args: dict[str, Any], env: dict[str, str] | None = None,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        import ray

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(server_argv(server_args, self.port, int(cpus) if cpus else None),
                                     env={**os.environ, **(env or {})}, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"servelm exited with code {self.proc.returncode} before it was ready")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self._stop()
                raise RuntimeError(f"servelm was not ready within {start_timeout_s:.0f}s")
            time.sleep(0.5)
        self.client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(None, connect=10.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def __call__(self, request: Any) -> Any:
        from starlette.background import BackgroundTask
        from starlette.responses import StreamingResponse

        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        upstream = self.client.build_request(request.method, request.url.path, params=request.query_params,
                                             headers=headers, content=await request.body())
        response = await self.client.send(upstream, stream=True)

        async def body() -> AsyncIterator[bytes]:
            async for chunk in response.aiter_raw():
                yield chunk

        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in _HOP_HEADERS}
        return StreamingResponse(body(), status_code=response.status_code, headers=out_headers,
                                 background=BackgroundTask(response.aclose))

    async def check_health(self) -> None:
        """Serve's periodic health check: the child is alive and answers /health."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"the servelm server exited with code {self.proc.returncode}")
        r = await self.client.get("/health", timeout=10)
        if r.status_code != 200:
            raise RuntimeError(f"the servelm server's /health answered {r.status_code}")

    def _stop(self) -> None:
        proc = getattr(self, "proc", None)  # None when __init__ failed before starting it
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()

    def __del__(self) -> None:
        self._stop()


def deployment(server_args: dict[str, Any], *, num_replicas: int | None = None,
               autoscaling_config: dict[str, Any] | None = None, ray_actor_options: dict[str, Any] | None = None,
               max_ongoing_requests: int | None = None, env: dict[str, str] | None = None,
               name: str = "servelm") -> Any:
    """A Ray Serve application of servelm replicas (give it to `serve.run`).

    `server_args`: servelm's flags as ServerArgs field names. `num_replicas` or `autoscaling_config` (Serve's:
    min_replicas, max_replicas, target_ongoing_requests, upscale_delay_s, ...). Each replica reserves
    `ray_actor_options["num_cpus"]` (default 1) and runs that many threads. A replica takes up to
    `max_ongoing_requests` requests at once (default: --max-running-requests plus --max-queued-requests, so
    the server's own batching sees them)."""
    from ray import serve

    options: dict[str, Any] = {"name": name, "ray_actor_options": {"num_cpus": 1, **(ray_actor_options or {})},
                               "max_ongoing_requests": max_ongoing_requests or int(
                                   server_args.get("max_running_requests", 64)) + int(
                                   server_args.get("max_queued_requests", 256)),
                               "health_check_period_s": 5, "graceful_shutdown_timeout_s": 30}
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config
    elif num_replicas is not None:
        options["num_replicas"] = num_replicas
    return serve.deployment(ServelmServer).options(**options).bind(dict(server_args), env)


def build_app(args: dict[str, str]) -> Any:
    """`serve run servelm.integrations.ray:build_app model_path=... [num_replicas=N] [num_cpus=C] [flag=value]`:
    the other keys are servelm flags (ServerArgs field names)."""
    args = dict(args)
    replicas = args.pop("num_replicas", None)
    cpus = args.pop("num_cpus", None)
    flags: dict[str, Any] = {k: (True if v == "true" else False if v == "false" else v) for k, v in args.items()}
    return deployment(flags, num_replicas=int(replicas) if replicas else None,
                      ray_actor_options={"num_cpus": float(cpus)} if cpus else None)
