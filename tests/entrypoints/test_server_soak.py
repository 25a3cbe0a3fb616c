"""A bounded soak over real HTTP: a few hundred mixed requests with 20% hang-ups; afterwards no KV page is
in use, the KV bookkeeping is intact, nothing is in flight, and stopping leaves no process behind."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.server_fixtures import start_server
from tests.soak_driver import soak

pytestmark = pytest.mark.slow  # starts servers, spawns ranks or loads the default model


def test_soak_leaves_no_kv_page_request_or_process(tiny_llama: tuple[Path, object], tmp_path: Path) -> None:
    srv = start_server(["--model-path", str(tiny_llama[0]), "--disable-torch-compile", "--max-total-tokens", "4096",
                        "--served-model-name", "tiny", "--max-running-requests", "16"], tmp_path / "server.log")
    try:
        children = srv.children()
        stats = asyncio.run(soak(srv.base_url, requests=300, concurrency=8))
        assert stats["status 200"] >= 200 and stats["hung up"] >= 30, stats
        assert not [k for k in stats if k.startswith("status 5")], stats
        deadline = time.monotonic() + 30
        while True:
            info = httpx.get(f"{srv.base_url}/server_info", timeout=10).json()
            if info["num_in_flight"] == 0 and info["num_running"] == 0 and info["num_waiting"] == 0:
                break
            assert time.monotonic() < deadline, info
            time.sleep(0.1)
        assert info["kv_in_use_tokens"] == 0 and info["kv_integrity_ok"] is True, info
        assert info["aborted_total"] > 0
        # Still serving.
        r = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        assert srv.stop(signal.SIGTERM) == 0, srv.log()[-3000:]
        _, alive = psutil.wait_procs(children, timeout=10)
        assert alive == []
        assert "Traceback" not in srv.log()
    finally:
        srv.stop(signal.SIGKILL)
