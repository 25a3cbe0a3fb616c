"""The chat page at `/`, in a real headless browser: Debian's chromium and chromium-driver, driven by selenium.

A real server on a tiny random model, each scheduler step slowed down (`slow_step_scheduler`) so that an
answer streams in over many network reads on any machine and a long one is still running when Stop is
clicked. Screenshots go to the test's tmp_path and, when `$SERVELM_TEST_ARTIFACTS` is set, are copied there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_fixtures import ServerProcess, start_server

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
    pytest.skip(f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}): "
                "apt-get install -y chromium chromium-driver (.ci/run installs them)", allow_module_level=True)
pytest.importorskip("selenium", reason="needs selenium (pip install -e '.[test]')")

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webelement import WebElement  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.slow  # starts servers, spawns ranks or loads the default model

WAIT_S = 60.0  # any one wait in a browser, on a busy machine
KEY = "s3cret-key"
SLOW_STEPS = {"SERVELM_SCHEDULER_FACTORY": "tests.server_fixtures:slow_step_scheduler",
              "SERVELM_TEST_STEP_DELAY_S": "0.05"}


def _serve(tiny_llama: tuple[Path, object], tmp_path_factory: pytest.TempPathFactory,
           extra: list[str]) -> Iterator[ServerProcess]:
    model_dir, _ = tiny_llama
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = start_server(["--model-path", str(model_dir), "--disable-torch-compile", "--max-total-tokens", "4096",
                        "--served-model-name", "tiny", *extra], log, env=SLOW_STEPS)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
    assert "Traceback" not in srv.log(), srv.log()[-3000:]


@pytest.fixture(scope="module")
def server(tiny_llama: tuple[Path, object], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _serve(tiny_llama, tmp_path_factory, [])


@pytest.fixture(scope="module")
def keyed_server(tiny_llama: tuple[Path, object],
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _serve(tiny_llama, tmp_path_factory, ["--api-key", KEY])


@pytest.fixture(scope="module")
def driver() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,860", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SE_OFFLINE", "true")  # with both paths given selenium-manager has nothing to fetch; and never may
        browser = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    browser.set_page_load_timeout(WAIT_S)
    browser.set_script_timeout(WAIT_S)
    yield browser
    browser.quit()


@pytest.fixture
def screenshot(tmp_path: Path, driver: webdriver.Chrome) -> Callable[[str], Path]:
    def save(name: str) -> Path:
        path = tmp_path / name
        assert driver.save_screenshot(str(path)), f"no screenshot saved at {path}"
        if os.environ.get("SERVELM_TEST_ARTIFACTS"):
            out = Path(os.environ["SERVELM_TEST_ARTIFACTS"])
            out.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, out / name)
        return path
    return save


def wait(driver: webdriver.Chrome, what: str, condition: Callable[[Any], Any], timeout: float = WAIT_S) -> Any:
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition, f"timed out waiting for {what}")


def el(driver: webdriver.Chrome, element_id: str) -> WebElement:
    return driver.find_element(By.ID, element_id)


def fill(driver: webdriver.Chrome, element_id: str, value: str) -> None:
    field = el(driver, element_id)
    field.clear()
    field.send_keys(value)


def open_page(driver: webdriver.Chrome, srv: ServerProcess) -> None:
    driver.get(srv.base_url + "/")
    wait(driver, "the model list", lambda d: el(d, "model").get_attribute("value") == "tiny")


def last_answer(driver: webdriver.Chrome) -> WebElement:
    return driver.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")[-1]


def send(driver: webdriver.Chrome, text: str) -> WebElement:
    """Type `text`, click Send; the new answer's element once it exists."""
    before = len(driver.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant"))
    wait(driver, "Send to be enabled", lambda d: el(d, "send").is_enabled())
    fill(driver, "prompt", text)
    el(driver, "send").click()
    wait(driver, "the answer's element",
         lambda d: len(d.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")) > before)
    return last_answer(driver)


def outcome(driver: webdriver.Chrome, answer: WebElement, timeout: float = WAIT_S) -> str:
    return wait(driver, "the answer to end", lambda d: answer.get_attribute("data-outcome"), timeout)


def num_in_flight(srv: ServerProcess, headers: dict[str, str] | None = None) -> int:
    r = httpx.get(f"{srv.base_url}/server_info", headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["num_in_flight"]


# Records the answer's text length at each DOM update the page makes (what a user sees change).
OBSERVE = """
window.__lengths = [];
const box = document.getElementById('messages');
new MutationObserver(() => {
  const answers = box.querySelectorAll('.msg.assistant .content');
  if (answers.length) window.__lengths.push(answers[answers.length - 1].textContent.length);
}).observe(box, {childList: true, characterData: true, subtree: true});
"""


def test_page_streams_an_answer(server: ServerProcess, driver: webdriver.Chrome,
                                screenshot: Callable[[str], Path]) -> None:
    open_page(driver, server)
    assert driver.title == "servelm chat"
    fill(driver, "temperature", "0")
    fill(driver, "max-tokens", "24")
    fill(driver, "system", "You are a concise assistant.")
    driver.execute_script(OBSERVE)
    answer = send(driver, "Hello! Who are you?")
    assert outcome(driver, answer) == "finish: length"
    text = answer.find_element(By.CSS_SELECTOR, ".content").text
    lengths = [n for n in driver.execute_script("return window.__lengths") if n]
    assert len(set(lengths)) >= 3 and lengths == sorted(lengths), f"the answer did not stream in: {lengths}"
    meta = answer.find_element(By.CSS_SELECTOR, ".meta").text
    assert re.fullmatch(r"TTFT \d+ ms · [\d.]+ tok/s · 24 tokens · finish: length", meta), meta

    # What the page showed is what the API answers for the same conversation (greedy).
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "temperature": 0, "max_tokens": 24, "messages": [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Hello! Who are you?"}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].strip() == text.strip()
    assert el(driver, "error").is_displayed() is False
    screenshot("chat_page_answer.png")

    # A second turn sends the first one as history; the page stays usable.
    fill(driver, "max-tokens", "4")
    second = send(driver, "And then?")
    assert outcome(driver, second) == "finish: length"
    assert len(driver.find_elements(By.CSS_SELECTOR, "#messages .msg")) == 4


def test_stop_aborts_a_long_answer(server: ServerProcess, driver: webdriver.Chrome,
                                   screenshot: Callable[[str], Path]) -> None:
    open_page(driver, server)
    fill(driver, "max-tokens", "900")  # 45 s at 0.05 s a step: still running when Stop is clicked
    answer = send(driver, "Tell me a very long story.")
    wait(driver, "some tokens", lambda d: len(answer.find_element(By.CSS_SELECTOR, ".content").text) >= 60)
    assert num_in_flight(server) == 1
    assert el(driver, "send").is_enabled() is False
    el(driver, "stop").click()
    assert outcome(driver, answer, timeout=10) == "stopped"
    meta = answer.find_element(By.CSS_SELECTOR, ".meta").text
    tokens = int(re.search(r"~(\d+) tokens · stopped$", meta).group(1))
    assert 0 < tokens < 900, meta
    deadline = time.monotonic() + 20
    while num_in_flight(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert num_in_flight(server) == 0, "the server still runs the request the page stopped"
    assert el(driver, "stop").is_enabled() is False and el(driver, "send").is_enabled()
    screenshot("chat_page_stopped.png")


def test_errors_are_shown(server: ServerProcess, driver: webdriver.Chrome) -> None:
    open_page(driver, server)
    fill(driver, "schema", "{not json")
    fill(driver, "prompt", "Hi")
    el(driver, "send").click()
    wait(driver, "the schema error", lambda d: "not valid JSON" in el(d, "error").text)
    assert not driver.find_elements(By.CSS_SELECTOR, "#messages .msg")  # nothing was sent

    # The server's 400 (OpenAI error shape) reaches the user.
    fill(driver, "schema", "")
    fill(driver, "max-tokens", "5000")
    answer = send(driver, "Hi")
    assert outcome(driver, answer) == "failed"
    assert re.search(r"Error 400: .*maximum context length", el(driver, "error").text), el(driver, "error").text

    # A JSON schema constrains the answer.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fill(driver, "schema", json.dumps(schema))
    fill(driver, "max-tokens", "40")
    fill(driver, "temperature", "0")
    answer = send(driver, "Answer in JSON.")
    assert outcome(driver, answer) == "finish: stop"
    assert json.loads(answer.find_element(By.CSS_SELECTOR, ".content").text) in ({"ok": True}, {"ok": False})
    assert not el(driver, "error").is_displayed()


def test_api_key(keyed_server: ServerProcess, driver: webdriver.Chrome, screenshot: Callable[[str], Path]) -> None:
    srv = keyed_server
    assert httpx.get(f"{srv.base_url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{srv.base_url}/static/chat.js", timeout=10).status_code == 200
    # The open /static/ prefix opens nothing else: a raw '..' (which httpx would remove) finds no endpoint.
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(b"GET /static/../v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert sock.recv(64).startswith(b"HTTP/1.1 404"), "the page's open prefix reached an endpoint"
    driver.get(srv.base_url + "/")  # the page itself needs no key ...
    wait(driver, "the key field", lambda d: el(d, "key-form").is_displayed())
    assert "needs an API key" in el(driver, "error").text  # ... it asks for one
    assert not el(driver, "send").is_enabled()

    fill(driver, "api-key", "wrong")
    el(driver, "key-form").find_element(By.CSS_SELECTOR, "button").click()
    wait(driver, "the refusal", lambda d: "refused the API key (401)" in el(d, "error").text)
    screenshot("chat_page_api_key.png")

    fill(driver, "api-key", KEY)
    el(driver, "key-form").find_element(By.CSS_SELECTOR, "button").click()
    wait(driver, "the model list", lambda d: el(d, "model").get_attribute("value") == "tiny")
    assert not el(driver, "key-form").is_displayed() and not el(driver, "error").is_displayed()
    fill(driver, "max-tokens", "6")
    answer = send(driver, "Hi")
    assert outcome(driver, answer) == "finish: length"
    assert answer.find_element(By.CSS_SELECTOR, ".content").text
    assert driver.execute_script("return sessionStorage.getItem('servelm.apiKey')") == KEY


def test_api_docs_offline(server: ServerProcess, driver: webdriver.Chrome) -> None:
    """/docs uses local Swagger UI files (fastapi-offline), nothing from a CDN."""
    pytest.importorskip("fastapi_offline", reason="without fastapi-offline /docs loads Swagger UI from a CDN")
    html = httpx.get(f"{server.base_url}/docs", timeout=10).text
    assert "cdn." not in html and "/static/docs/swagger-ui-bundle.js" in html
    assert httpx.get(f"{server.base_url}/static/docs/swagger-ui-bundle.js", timeout=10).status_code == 200
    driver.get(server.base_url + "/docs")
    wait(driver, "Swagger UI to render", lambda d: d.find_elements(By.CSS_SELECTOR, ".swagger-ui .opblock"))
    assert "/v1/chat/completions" in driver.find_element(By.CSS_SELECTOR, ".swagger-ui").text
