"""The prefix cache's disk tier (`--prefix-cache-dir`, servelm/mem_cache/disk_cache.py), end to end with a
tiny random model: a prefix survives a restart and is read back instead of recomputed (same tokens), another
model or KV dtype never hits, and a torn or corrupt file is skipped with a log line, never served."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

from servelm.config import ServerArgs
from servelm.dataclass_flags import ConfigError
from servelm.entrypoints.engine import Engine
from servelm.mem_cache import disk_cache
from tests.conftest import build_tiny_model

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory, default_tokenizer_dir) -> list[Path]:
    return [build_tiny_model(tmp_path_factory.mktemp(f"m{i}"), default_tokenizer_dir, "llama", std=0.5,
                             seed=i)[0] for i in range(2)]


def _prompt(n: int = 700, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def _run(model: Path, cache_dir: Path, prompts: list[list[int]], **kw) -> list[dict]:
    engine = Engine(model_path=str(model), max_total_tokens=4096, prefix_cache_dir=str(cache_dir), **kw)
    try:
        return [engine.generate(input_ids=p, sampling_params=GREEDY) for p in prompts]
    finally:
        engine.shutdown()  # waits for the queued files


def test_a_prefix_survives_a_restart(models, tmp_path) -> None:
    prompt = _prompt()
    cold = _run(models[0], tmp_path, [prompt])[0]
    assert cold["usage"]["cached_tokens"] == 0
    files = list(tmp_path.glob("*/*.kv"))
    assert len(files) == 1  # the finished request's 512 whole-block tokens (of 705 computed)
    warm = _run(models[0], tmp_path, [prompt])[0]
    assert warm["usage"]["cached_tokens"] == 512 and warm["output_ids"] == cold["output_ids"]
    shared = prompt[:600] + _prompt(50, seed=1)  # the first two blocks, then its own tokens
    warm = _run(models[0], tmp_path, [shared])[0]
    assert warm["usage"]["cached_tokens"] == 512
    without = _run(models[0], tmp_path / "elsewhere", [shared])[0]
    assert warm["output_ids"] == without["output_ids"]  # the KV read back is the KV computed


def test_another_model_or_kv_dtype_never_hits(models, tmp_path) -> None:
    prompt = _prompt(seed=2)
    _run(models[0], tmp_path, [prompt])
    assert _run(models[1], tmp_path, [prompt])[0]["usage"]["cached_tokens"] == 0
    assert _run(models[0], tmp_path, [prompt], kv_cache_dtype="int8")[0]["usage"]["cached_tokens"] == 0
    assert len(list(tmp_path.iterdir())) == 3  # one folder per model and layout
    assert _run(models[0], tmp_path, [prompt])[0]["usage"]["cached_tokens"] == 512


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "tmp"])
def test_a_torn_or_corrupt_file_is_skipped(models, tmp_path, caplog, damage: str) -> None:
    prompt = _prompt(seed=3)
    cold = _run(models[0], tmp_path, [prompt])[0]
    (f,) = tmp_path.glob("*/*.kv")
    data = f.read_bytes()
    if damage == "truncate":  # what a write cut short would leave, had it not been renamed only when done
        f.write_bytes(data[: len(data) // 2])
    elif damage == "flip":  # a bit flipped in the KV: only the checksum can tell
        f.write_bytes(data[:-100] + bytes([data[-100] ^ 1]) + data[-99:])
    elif damage == "garbage":
        f.write_bytes(b"not a kv file at all")
    else:  # a killed writer's temporary file next to nothing else
        f.rename(f.with_suffix(".123.tmp"))
    with caplog.at_level(logging.WARNING, logger="servelm.mem_cache.disk_cache"):
        again = _run(models[0], tmp_path, [prompt])[0]
    assert again["usage"]["cached_tokens"] == 0 and again["output_ids"] == cold["output_ids"]
    if damage != "tmp":
        assert any("Prefix cache:" in r.getMessage() and f.name in r.getMessage() for r in caplog.records)
    assert not list(tmp_path.glob("*/*.tmp"))
    assert len(list(tmp_path.glob("*/*.kv"))) == 1  # the damaged file is gone, the fresh one written


def test_the_size_cap_drops_the_least_recently_used(models, tmp_path) -> None:
    per_file = disk_cache.BLOCK * 2 * 2 * 16 * 4 * 2  # 256 tokens x layers x kv heads x head_dim x fp32 x K/V
    _run(models[0], tmp_path, [_prompt(300, seed=s) for s in range(4)], prefix_cache_size_gb=2.5 * per_file / 1e9)
    assert len(list(tmp_path.glob("*/*.kv"))) == 2


def test_flags_are_checked() -> None:
    with pytest.raises(ConfigError, match="--tp-size 1"):
        ServerArgs(prefix_cache_dir="/tmp/x", tp_size=2)
    with pytest.raises(ConfigError, match="divides 256"):
        ServerArgs(prefix_cache_dir="/tmp/x", page_size=3)


@pytest.mark.slow
def test_a_killed_server_restarts_and_serves(models, tmp_path) -> None:
    """SIGKILL to the whole server right after a request finished (its file may be half written): the next
    server starts, serves the same prompt with the same tokens, and leaves no temporary file behind."""
    import signal

    import openai

    from tests.server_fixtures import start_server

    args = ["--model-path", str(models[0]), "--max-total-tokens", "4096", "--prefix-cache-dir", str(tmp_path / "c")]
    prompt = _prompt(seed=7)
    texts = []
    for run in range(2):
        server = start_server(args, tmp_path / f"server{run}.log")
        try:
            client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=60, max_retries=0)
            model = client.models.list().data[0].id
            out = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
            texts.append(out.choices[0].text)
            if run == 0:
                for child in server.children():
                    child.kill()
                server.stop(signal.SIGKILL)
        finally:
            server.stop(signal.SIGKILL if run == 0 else signal.SIGTERM)
    assert texts[0] == texts[1]
    assert not list((tmp_path / "c").glob("*/*.tmp"))
