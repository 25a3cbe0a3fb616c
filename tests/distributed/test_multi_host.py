"""Tensor parallelism across real hosts: TP=2 with one rank in each of two network namespaces (own network
stacks, an `eth0` each on a bridge, own hostnames that resolve nowhere), as two machines on one switch.

Each rank must find the interface that routes to --dist-init-addr by itself (the hostname would give gloo an
address the peer cannot reach). The greedy tokens equal TP=1's; a link that drops for less than
--dist-timeout is survived; a longer outage or a host that dies ends the other host's server with one line
naming the lost node, and nothing hangs or stays behind."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from servelm.entrypoints.engine import Engine
from tests.distributed.netns import Hosts, make_hosts
from tests.server_fixtures import REPO_ROOT, STEP_DELAY_ENV, GroupProcess

pytestmark = pytest.mark.slow  # starts servers and rank processes

PROMPTS = [[5, 17, 300, 42], [9, 8, 7, 6, 5, 4, 3], [1000, 20, 33]]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
PORT = 8000
RDV_PORT = 29511


@pytest.fixture(scope="module")
def tp1_tokens(tiny_llama: tuple[Path, Any]) -> list[list[int]]:
    engine = Engine(model_path=str(tiny_llama[0]), max_total_tokens=2048)
    try:
        return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    finally:
        engine.shutdown()


class Node(GroupProcess):
    """`servelm serve --node-rank i` on host i, logging to a file."""

    def __init__(self, hosts: Hosts, i: int, model: Path, log: Path, *extra: str,
                 env: dict[str, str] | None = None) -> None:
        argv = [sys.executable, "-m", "servelm", "serve", "--model-path", str(model), "--disable-torch-compile",
                "--max-total-tokens", "2048", "--tp-size", "2", "--nnodes", "2", "--node-rank", str(i),
                "--dist-init-addr", f"{hosts.addr(0)}:{RDV_PORT}", "--host", hosts.addr(i), "--port", str(PORT),
                *extra]
        full_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
        full_env.pop("GLOO_SOCKET_IFNAME", None)
        super().__init__(hosts.command(i, argv), log, full_env, REPO_ROOT)


def _start_pair(hosts: Hosts, model: Path, tmp_path: Path, *extra: str,
                env0: dict[str, str] | None = None) -> tuple[Node, Node, str]:
    node1 = Node(hosts, 1, model, tmp_path / "node1.log", *extra)
    node0 = Node(hosts, 0, model, tmp_path / "node0.log", *extra, env=env0)
    url = f"http://{hosts.addr(0)}:{PORT}"
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        for node in (node0, node1):
            if node.proc.poll() is not None:
                raise AssertionError(f"a node exited early:\n{node0.log()[-3000:]}\n---\n{node1.log()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return node0, node1, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"not ready:\n{node0.log()[-3000:]}\n---\n{node1.log()[-3000:]}")


def _generate(url: str, ids: list[int], max_new_tokens: int = 8, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": {**GREEDY, "max_new_tokens":
                                                                                    max_new_tokens}},
                      timeout=timeout)


@pytest.fixture
def hosts() -> Any:
    h = make_hosts(2)
    yield h
    h.teardown()


def test_tp2_across_two_hosts_gives_tp1_tokens_and_survives_a_short_outage_not_a_long_one(
        hosts: Hosts, tiny_llama: tuple[Path, Any], tp1_tokens: list[list[int]], tmp_path: Path) -> None:
    node0, node1, url = _start_pair(hosts, tiny_llama[0], tmp_path, "--dist-timeout", "15")
    try:
        for i, node in enumerate((node0, node1)):
            assert (f"talks to its peers over eth0 ({hosts.addr(i)}), chosen by the route to {hosts.addr(0)}"
                    in node.log()), node.log()[-3000:]
        for ids, expected in zip(PROMPTS, tp1_tokens, strict=True):
            r = _generate(url, ids)
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == expected
        # Host 1's cable out for 3 s, well below --dist-timeout: the step waits, then completes.
        hosts.link(1, False)
        result: dict[str, httpx.Response] = {}
        thread = threading.Thread(target=lambda: result.update(r=_generate(url, PROMPTS[0])))
        thread.start()
        time.sleep(3)
        hosts.link(1, True)
        thread.join(120)
        assert result["r"].status_code == 200 and result["r"].json()["output_ids"] == tp1_tokens[0]
        # Out for longer than --dist-timeout: the request fails, and both servers stop with one line each.
        hosts.link(1, False)
        t0 = time.monotonic()
        r = _generate(url, PROMPTS[1])
        assert r.status_code >= 500 and "died" in r.text
        assert node0.proc.wait(60) != 0 and node1.proc.wait(60) != 0
        assert time.monotonic() - t0 < 90
    finally:
        hosts.link(1, True)
        node0.stop()
        node1.stop()
    log0, log1 = node0.log(), node1.log()
    assert f"TP rank 1 on node 1 ({hosts.addr(1)}) died or stopped answering" in log0, log0[-3000:]
    assert "Error: the TP ranks on node 1 lost their peers" in log1, log1[-3000:]
    assert "Traceback" not in log0 + log1


def test_a_host_that_dies_mid_request_ends_the_other_hosts_server_naming_it(
        hosts: Hosts, tiny_llama: tuple[Path, Any], tmp_path: Path) -> None:
    # Slow steps on rank 0, so that the request is surely running when host 1 dies.
    env = {"SERVELM_SCHEDULER_FACTORY": "tests.server_fixtures:slow_step_scheduler", STEP_DELAY_ENV: "0.05"}
    node0, node1, url = _start_pair(hosts, tiny_llama[0], tmp_path, env0=env)
    try:
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["r"] = _generate(url, PROMPTS[2], max_new_tokens=600)
            except httpx.HTTPError as exc:
                result["r"] = exc

        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(2)
        os.killpg(node1.proc.pid, signal.SIGKILL)  # the whole host: its server and its TP rank
        thread.join(90)
        assert not thread.is_alive()
        r = result["r"]
        assert isinstance(r, httpx.Response) and r.status_code >= 500, r
        assert node0.proc.wait(60) != 0
    finally:
        node0.stop()
        node1.stop()
    log0 = node0.log()
    assert f"TP rank 1 on node 1 ({hosts.addr(1)}) died or stopped answering" in log0, log0[-3000:]
    assert "Traceback" not in log0
    lines = [line for line in log0.splitlines() if line.startswith("Error:")]
    assert lines == ["Error: The scheduler process (TP rank 0) died unexpectedly (exit code 1); stopping"], lines
