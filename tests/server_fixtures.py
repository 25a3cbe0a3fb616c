"""Helpers for the server tests: run `python -m servelm serve` in a subprocess on a free port.

Also holds `slow_start_scheduler`, a scheduler factory for
`SERVELM_SCHEDULER_FACTORY` that waits before loading the real scheduler, so
that tests can see the server while it is still starting.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent
SLOW_START_ENV = "SERVELM_TEST_SCHEDULER_DELAY_S"


def slow_start_scheduler(server_args: Any) -> Any:
    """Sleep `$SERVELM_TEST_SCHEDULER_DELAY_S` seconds, then build the real scheduler."""
    time.sleep(float(os.environ.get(SLOW_START_ENV, "3")))
    from servelm.managers.engine_core import build_scheduler

    return build_scheduler(server_args)


STEP_DELAY_ENV = "SERVELM_TEST_STEP_DELAY_S"


def slow_step_scheduler(server_args: Any) -> Any:
    """The real scheduler, each step delayed by `$SERVELM_TEST_STEP_DELAY_S` seconds: requests that
    outlast a test's deadlines on any machine, however fast."""
    from servelm.managers.engine_core import build_scheduler

    scheduler = build_scheduler(server_args)
    step, delay = scheduler.step, float(os.environ.get(STEP_DELAY_ENV, "0.05"))

    def slow_step() -> Any:
        time.sleep(delay)
        return step()

    scheduler.step = slow_step
    return scheduler


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GroupProcess:
    """A command in a session (process group) of its own, logging to a file; `stop` ends the whole group: SIGTERM,
    then SIGKILL after `timeout` seconds."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


class ServerProcess:
    """`python -m servelm serve <args>` in a subprocess, logging to a file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
                    **(env or {})}
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "servelm", "serve", *args, "--port", str(self.port)],
            cwd=REPO_ROOT, env=full_env, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []

    def wait_exit(self, timeout: float) -> int:
        """The server's exit code, once it exits by itself within `timeout`; otherwise an AssertionError
        that shows what was still running and the end of the server's log (so a CI failure says why)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            procs = []
            for p in [psutil.Process(self.proc.pid), *self.children()]:
                try:
                    procs.append(f"{p.pid} {p.status()} {' '.join(p.cmdline())[:120]}")
                except psutil.Error:
                    pass
            raise AssertionError(f"server still running after {timeout:g}s:\n" + "\n".join(procs)
                                 + f"\n--- log ---\n{self.log()[-4000:]}") from None

    def wait_ready(self, timeout: float = 120.0, headers: dict[str, str] | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Send `sig`, wait for the exit, and return the exit code (killing it after `timeout`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


def start_server(args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 timeout: float = 120.0) -> ServerProcess:
    server = ServerProcess(args, log_path, env)
    try:
        server.wait_ready(timeout)
    except BaseException:
        server.stop(signal.SIGKILL)
        raise
    return server


def sse_events(server: ServerProcess, path: str, body: dict, timeout: float = 60.0) -> list[dict]:
    """POST `body` with stream=True to `path`; the JSON events of its server-sent stream ([DONE] left out)."""
    with httpx.stream("POST", server.base_url + path, json={**body, "stream": True}, timeout=timeout) as resp:
        assert resp.status_code == 200
        return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
