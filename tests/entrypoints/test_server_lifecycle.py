"""Server lifecycle and limits: 503 while starting, ready line, API key, 429 on a full queue,
clean Ctrl-C/SIGTERM shutdown, no orphan scheduler after the parent is killed, the default model."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.server_fixtures import SLOW_START_ENV, STEP_DELAY_ENV, ServerProcess, start_server

pytestmark = pytest.mark.slow  # starts servers, spawns ranks or loads the default model

MESSAGES = [{"role": "user", "content": "Write a long poem."}]
TINY_ARGS = ["--disable-torch-compile", "--max-total-tokens", "8192"]
CHAT_TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}{{ tail | default('') }}"


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return alive


@pytest.fixture(scope="module")
def guarded_server(tiny_llama: tuple[Path, object],
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """API key, room for one running plus one queued request, a chat template override, request logs."""
    log = tmp_path_factory.mktemp("guarded") / "server.log"
    srv = start_server(["--model-path", str(tiny_llama[0]), *TINY_ARGS, "--api-key", "sk-secret",
                        "--max-running-requests", "1", "--max-queued-requests", "1",
                        "--chat-template", CHAT_TEMPLATE, "--log-requests"], log)
    yield srv
    srv.stop(signal.SIGKILL)


def test_api_key(guarded_server: ServerProcess) -> None:
    url = guarded_server.base_url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-secret"}):
        r = httpx.get(f"{url}/v1/models", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-secret", max_retries=0)
    model = good.models.list().data[0].id
    r = good.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1
    # Liveness and metrics stay open for probes.
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    assert "sk-secret" not in httpx.get(f"{url}/server_info", headers={"Authorization": "Bearer sk-secret"}).text


def test_chat_template_override_and_request_log(guarded_server: ServerProcess) -> None:
    url, headers = guarded_server.base_url, {"Authorization": "Bearer sk-secret"}
    ids = httpx.post(f"{url}/v1/tokenize", headers=headers,
                     json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    assert httpx.post(f"{url}/v1/detokenize", headers=headers, json={"tokens": ids}).json()["prompt"] == "<<hi>>"
    # chat_template_kwargs (vLLM/SGLang) reach the template as its variables.
    with_tail = httpx.post(f"{url}/v1/tokenize", headers=headers, json={
        "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tail": "!!"}}).json()["tokens"]
    assert httpx.post(f"{url}/v1/detokenize", headers=headers, json={"tokens": with_tail}).json()["prompt"] == \
        "<<hi>>!!"
    r = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=30,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "rid": "logged-req"})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)
    assert "request logged-req finished" in guarded_server.log()


def test_full_queue_answers_429(guarded_server: ServerProcess) -> None:
    url = guarded_server.base_url
    headers = {"Authorization": "Bearer sk-secret"}
    body = {"messages": MESSAGES, "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    with ExitStack() as stack:
        for _ in range(2):  # one running, one queued
            resp = stack.enter_context(httpx.stream("POST", f"{url}/v1/chat/completions", json=body,
                                                    headers=headers, timeout=30))
            assert resp.status_code == 200
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False}, headers=headers, timeout=10)
        assert time.monotonic() - t0 < 5
        assert r.status_code == 429
        assert r.headers["Retry-After"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_exceeded"
    # The hung-up streams were aborted, so there is room again.
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/server_info", headers=headers).json()["num_in_flight"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2},
                   headers=headers, timeout=30)
    assert r.status_code == 200


def test_parent_killed_takes_scheduler_down(guarded_server: ServerProcess) -> None:
    children = guarded_server.children()
    assert children, "the scheduler process should be a child of the server"
    guarded_server.proc.kill()  # SIGKILL: no cleanup code runs in the parent
    guarded_server.proc.wait(5)
    assert wait_gone(children, timeout=5) == []


def test_startup_503_ready_line_and_sigint(tiny_llama: tuple[Path, object], tmp_path: Path) -> None:
    srv = ServerProcess(["--model-path", str(tiny_llama[0]), *TINY_ARGS], tmp_path / "server.log",
                        env={"SERVELM_SCHEDULER_FACTORY": "tests.server_fixtures:slow_start_scheduler",
                             SLOW_START_ENV: "4"})
    try:
        statuses = set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{srv.base_url}/health", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.1)
                continue
            statuses.add(r.status_code)
            if r.status_code == 503:
                chat = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=60,
                                  json={"messages": MESSAGES, "max_tokens": 2})
                if chat.status_code == 503:  # still starting (it may have just become ready)
                    assert chat.json()["error"]["type"] == "service_unavailable"
            if r.status_code == 200:
                break
            time.sleep(0.1)
        assert statuses == {503, 200}
        log = srv.log()
        line = next(ln for ln in log.splitlines() if "servelm ready" in ln)
        assert "float32" in line and "KV capacity 8192 tokens" in line and srv.base_url in line
        # Nothing before it says the server runs (uvicorn's "Uvicorn running on" is replaced by a line that
        # says it is still loading); each request gets an access log line.
        assert "Uvicorn running" not in log and "loading the model (requests get 503 until it is ready)" in log
        assert '"GET /health HTTP/1.1" 503' in log and '"GET /health HTTP/1.1" 200' in log

        # Ctrl-C in the middle of a stream: everything stops within seconds.
        children = srv.children()
        assert children
        with httpx.stream("POST", f"{srv.base_url}/v1/completions", timeout=30,
                          json={"prompt": "hi", "max_tokens": 900, "ignore_eos": True, "stream": True}) as resp:
            first = next(resp.iter_lines())
            assert first.startswith("data: ") and json.loads(first[6:])["choices"]
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGINT)
            srv.proc.wait(15)
        assert time.monotonic() - t0 < 10
        assert srv.proc.returncode == 0, srv.log()[-3000:]
        assert wait_gone(children, timeout=5) == []
    finally:
        srv.stop(signal.SIGKILL)


def test_default_model_serves_and_sigterm(tmp_path: Path) -> None:
    """No --model-path: the embedded default model (SmolLM2-135M-Instruct GGUF) answers a chat."""
    srv = start_server(["--disable-torch-compile", "--max-total-tokens", "4096"], tmp_path / "server.log",
                       timeout=180)
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        assert model == "SmolLM2-135M-Instruct.Q4_1"
        r = client.chat.completions.create(model=model, temperature=0, max_tokens=8,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert r.choices[0].message.content.strip()
        assert r.usage.completion_tokens <= 8
        children = srv.children()
        t0 = time.monotonic()
        assert srv.stop(signal.SIGTERM) == 0
        assert time.monotonic() - t0 < 10
        assert wait_gone(children, timeout=5) == []
    finally:
        srv.stop(signal.SIGKILL)


def test_sigterm_drains_then_ends_running_requests_cleanly(tiny_llama: tuple[Path, object], tmp_path: Path) -> None:
    """SIGTERM: new requests get 503 at once, a short request still finishes within --shutdown-timeout, and
    the long ones then end with a proper error (a 503 JSON body; an SSE error event, then [DONE]); one log
    line, no traceback, exit code 0."""
    srv = start_server(["--model-path", str(tiny_llama[0]), *TINY_ARGS, "--shutdown-timeout", "3"],
                       tmp_path / "server.log",
                       env={"SERVELM_SCHEDULER_FACTORY": "tests.server_fixtures:slow_step_scheduler",
                            STEP_DELAY_ENV: "0.05"})
    url = srv.base_url
    long_body = {"prompt": "hi", "max_tokens": 900, "ignore_eos": True}
    results: dict[str, httpx.Response] = {}

    def post(name: str, body: dict) -> None:
        results[name] = httpx.post(f"{url}/v1/completions", json=body, timeout=60)

    try:
        children = srv.children()
        with httpx.stream("POST", f"{url}/v1/completions", json={**long_body, "stream": True}, timeout=60) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            threads = [threading.Thread(target=post, args=("long", long_body)),
                       threading.Thread(target=post, args=("short", {"prompt": "hi", "max_tokens": 4,
                                                                     "ignore_eos": True}))]
            threads[0].start()
            deadline = time.monotonic() + 30
            while httpx.get(f"{url}/server_info", timeout=10).json()["num_in_flight"] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            threads[1].start()
            while httpx.get(f"{url}/server_info", timeout=10).json()["num_in_flight"] < 3:
                assert time.monotonic() < deadline, results
                time.sleep(0.01)
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=10)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["type"] == "service_unavailable"
            rest = list(lines)
        for t in threads:
            t.join(30)
        assert srv.proc.wait(20) == 0, srv.log()[-3000:]
        assert time.monotonic() - t0 < 15
    finally:
        srv.stop(signal.SIGKILL)
    # The short request finished within the grace period; the long ones were ended after it.
    assert results["short"].status_code == 200
    assert results["short"].json()["choices"][0]["finish_reason"] == "length"
    assert results["long"].status_code == 503
    assert results["long"].json()["error"] == {"message": "The server is shutting down",
                                               "type": "service_unavailable", "param": None, "code": None}
    events = [ln for ln in rest if ln.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["type"] == "service_unavailable"
    log = srv.log()
    assert log.count("Shutting down: ending 2 running request(s) with an error after the 3s grace period") == 1
    assert "Traceback" not in log and "CancelledError" not in log
    assert wait_gone(children, timeout=5) == []
