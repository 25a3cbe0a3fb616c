"""TP reliability over real gloo ranks: an idle TP server (and Engine) outlives --dist-timeout, and a
killed rank is named once while the server goes down with nothing left behind.

Each server test starts real `servelm serve` processes (a TP group of 2 or 3 on this CPU); the module
takes about 2-3 minutes on a busy 2-core machine. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
import torch.distributed as dist
from distributed_harness import World

from servelm.distributed.parallel_state import get_tp_group, get_tp_rank
from tests.conftest import build_tiny_model
from tests.server_fixtures import REPO_ROOT, ServerProcess

pytestmark = pytest.mark.slow  # starts servers, spawns ranks or loads the default model

# Startup collectives (the rendezvous above all: rank 0 waits there while its workers import torch)
# have this deadline too, so it cannot be a few seconds on a busy 2-core machine.
DIST_TIMEOUT_S = 20
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
PROMPT = [5, 17, 300, 42, 7, 99, 1234, 8]


@pytest.fixture(scope="module")
def tiny_tp_model(tmp_path_factory: pytest.TempPathFactory, default_tokenizer_dir: Path) -> Path:
    """A 2-layer random llama whose heads split over 2 and 3 ranks."""
    folder, _ = build_tiny_model(tmp_path_factory.mktemp("tiny_tp"), default_tokenizer_dir, "llama", std=0.5,
                                 hidden_size=96, num_attention_heads=6, num_key_value_heads=6, head_dim=16,
                                 intermediate_size=192)
    return folder


# ---------------------------------------------------------------- the step channel, on its own

def _channel_run(n_steps: int, timeout_s: float, seed: int) -> dict:
    """Rank 0 sends steps with idle gaps of up to 3 keep-alive intervals; every step runs a CPU-group
    and a device-group collective on every rank. Keep-alives must go out in the gaps, be skipped by the
    followers, and never land between a step's collectives (which would desynchronise them)."""
    from servelm.distributed.step_channel import StepSender, receive_steps

    group = get_tp_group()
    seen: list[tuple[int, list[int], float]] = []

    def run_step(step: int) -> None:
        parts: list = [None] * group.world_size
        dist.all_gather_object(parts, (step, get_tp_rank()), group=group.cpu_group)
        x = torch.full((4,), float(step))
        dist.all_reduce(x, group=group.device_group)
        seen.append((step, [p[0] for p in parts], float(x[0])))

    if get_tp_rank() != 0:
        for step in receive_steps():
            run_step(step)
        return {"seen": seen}
    failures: list[BaseException] = []
    sender = StepSender(timeout_s, failures.append)
    rng = random.Random(seed)
    for step in range(n_steps):
        with sender.lock:
            sender.send(step)
            run_step(step)
        time.sleep(rng.uniform(0, 3 * sender.interval_s))  # idle: keep-alives may go out now
    sender.close()
    return {"seen": seen, "keep_alives": sender.keep_alives_sent, "failures": [repr(f) for f in failures]}


def _keep_alive_to_a_peer_that_left(timeout_s: float) -> dict | None:
    """Rank 1 leaves the group (its sockets close, as when it dies); rank 0, idle, must hear of it
    from a keep-alive, as a collective failure."""
    from servelm.distributed.failures import first_line, is_collective_failure
    from servelm.distributed.parallel_state import TPGroup, set_tp_group
    from servelm.distributed.step_channel import StepSender

    if get_tp_rank() != 0:
        dist.destroy_process_group()
        set_tp_group(TPGroup())
        return None
    failed = threading.Event()
    failures: list[BaseException] = []

    def on_failure(exc: BaseException) -> None:
        failures.append(exc)
        failed.set()

    sender = StepSender(timeout_s, on_failure)
    reported = failed.wait(30)
    sender.stop()
    return {"reported": reported, "collective": [is_collective_failure(f) for f in failures],
            "errors": [first_line(f) for f in failures]}


def test_keep_alives_fill_idle_gaps_and_never_split_a_step() -> None:
    n_steps, ws = 25, 2
    with World(ws) as world:
        results = world.run(_channel_run, n_steps, 0.4, 0, timeout_s=60)
        assert results[0]["failures"] == []
        assert results[0]["keep_alives"] >= 3  # ~25 gaps of up to 0.3 s, one keep-alive per idle 0.1 s
        for res in results:
            assert res["seen"] == [(s, [s] * ws, float(s * ws)) for s in range(n_steps)]
        # The same world, broken on purpose (it is torn down right after).
        lost = world.run(_keep_alive_to_a_peer_that_left, 0.4, timeout_s=60)[0]
    assert lost["reported"] and lost["collective"] == [True], lost


# ---------------------------------------------------------------- idle past the timeout

_ENGINE_SCRIPT = """
import json, sys
from servelm.entrypoints.engine import Engine
folder, timeout, params, prompt = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
engine = Engine(model_path=folder, tp_size=2, dist_timeout=timeout, max_total_tokens=2048)
before = engine.generate(input_ids=prompt, sampling_params=params)["output_ids"]
print("ready", flush=True)
sys.stdin.readline()  # the test says when the idle time is over
after = engine.generate(input_ids=prompt, sampling_params=params)["output_ids"]
engine.shutdown()
print(json.dumps({"before": before, "after": after}), flush=True)
"""


def _readline(proc: subprocess.Popen, timeout_s: float) -> str:
    """The next line of `proc`'s stdout, waiting at most `timeout_s` (never forever)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline() if ready else ""


def _generate(srv: ServerProcess) -> list[int]:
    r = httpx.post(f"{srv.base_url}/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_idle_tp_server_and_engine_outlive_dist_timeout(tiny_tp_model: Path, tmp_path: Path) -> None:
    """Before the keep-alives, the followers' wait for the next step timed out after --dist-timeout
    idle seconds: the worker died and took the server (and the Engine's process) down with it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    engine_log = tmp_path / "engine.log"
    with open(engine_log, "wb") as stderr:  # a file, not a pipe nobody drains while idle
        engine = subprocess.Popen([sys.executable, "-c", _ENGINE_SCRIPT, str(tiny_tp_model), str(DIST_TIMEOUT_S),
                                   json.dumps(GREEDY), json.dumps(PROMPT)], cwd=REPO_ROOT, env=env, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
    srv: ServerProcess | None = None
    try:
        srv = ServerProcess(["--model-path", str(tiny_tp_model), "--tp-size", "2", "--dist-timeout",
                             str(DIST_TIMEOUT_S), "--max-total-tokens", "2048"], tmp_path / "server.log")
        srv.wait_ready(timeout=120)
        before = _generate(srv)
        assert _readline(engine, 120).strip() == "ready", engine_log.read_text()[-3000:]
        # Both TP groups are now idle, their followers waiting for the next step since before
        # this point: without keep-alives, that wait times out within DIST_TIMEOUT_S.
        time.sleep(DIST_TIMEOUT_S + 3)
        assert srv.proc.poll() is None, srv.log()[-3000:]
        assert _generate(srv) == before
        out, _ = engine.communicate("go\n", timeout=60)
        assert engine.returncode == 0, engine_log.read_text()[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        assert result["after"] == result["before"] == before  # same tiny model, TP=2 both
        # A clean stop is no death either (the followers are terminated at exit, keep-alives stopped first).
        assert srv.stop(signal.SIGTERM) == 0
        for log in (srv.log(), engine_log.read_text()):
            assert not re.search(r"died|lost its|keep-alive failed|Traceback", log), log[-3000:]
    finally:
        if srv is not None:
            srv.stop(signal.SIGKILL)
        if engine.poll() is None:
            engine.kill()
            engine.wait(10)


# ---------------------------------------------------------------- chaos: kill each rank under load

def _stream_until_cut(base_url: str, chunks: list[str], started: threading.Event) -> None:
    """A long streaming request; it ends when the server goes down."""
    body = {"input_ids": PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}}
    try:
        with httpx.stream("POST", f"{base_url}/generate", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.strip():
                    chunks.append(line)
                    if len(chunks) >= 3:
                        started.set()
    except httpx.HTTPError:
        pass
    finally:
        started.set()


@pytest.mark.parametrize("victim", [1, 2, 0])
def test_killed_rank_is_named_once_and_the_server_exits(victim: int, tiny_tp_model: Path, tmp_path: Path) -> None:
    srv = ServerProcess(["--model-path", str(tiny_tp_model), "--tp-size", "3", "--dist-timeout", "60",
                         "--max-total-tokens", "4096"], tmp_path / "server.log")
    try:
        srv.wait_ready(timeout=150)
        pids = {int(rank): int(pid) for rank, pid in re.findall(r"Started TP rank (\d+) \(pid (\d+)\)", srv.log())}
        assert sorted(pids) == [1, 2]
        sched = psutil.Process(pids[1]).parent()
        assert sched.ppid() == srv.proc.pid
        pids[0] = sched.pid
        family = srv.children()
        chunks: list[str] = []
        started = threading.Event()
        threading.Thread(target=_stream_until_cut, args=(srv.base_url, chunks, started), daemon=True).start()
        assert started.wait(60) and len(chunks) >= 3, srv.log()[-3000:]  # the request is running
        killed_at = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        code = srv.wait_exit(30)  # far sooner than --dist-timeout: not a timeout's doing
        assert code != 0
        assert time.monotonic() - killed_at < 30
        # Nothing left behind: the scheduler, the other ranks, multiprocessing's resource tracker.
        _, alive = psutil.wait_procs(family, timeout=15)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
        log = srv.log()
        assert "Traceback" not in log and "crashed" not in log, log[-4000:]
        named = re.findall(r"TP rank (\d+) (?:died|lost its TP peers)[^\n]*", log)
        if victim == 0:
            # Rank 0 is the scheduler process: the API process reports it, and no worker is blamed.
            assert named == [], log[-4000:]
            assert "scheduler process (TP rank 0) died unexpectedly (exit code -9)" in log, log[-4000:]
        else:
            assert named == [str(victim)], log[-4000:]
            assert f"TP rank {victim} died (exit code -9 / killed by SIGKILL); shutting down" in log
    finally:
        srv.stop(signal.SIGKILL)
