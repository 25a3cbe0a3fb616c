"""`servelm bench deterministic` against real `servelm serve` subprocesses on a tiny random Llama:
Unique samples: 1 everywhere with --enable-deterministic-inference, and more than one without it."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from servelm.bench import deterministic
from tests.server_fixtures import REPO_ROOT, ServerProcess, start_server

pytestmark = pytest.mark.slow  # starts servers, spawns ranks or loads the default model

LINE = re.compile(r"^(Prompt \d+ \(.*?\)): Total samples: (\d+), Unique samples: (\d+)$", re.M)


def _server(tiny_llama, tmp_path_factory: pytest.TempPathFactory, *flags: str) -> Iterator[ServerProcess]:
    model_dir, _ = tiny_llama
    log = tmp_path_factory.mktemp("det_server") / "server.log"
    srv = start_server(["--model-path", str(model_dir), "--max-total-tokens", "16384", "--chunked-prefill-size", "64",
                        *flags], log)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def det_server(tiny_llama, tmp_path_factory) -> Iterator[ServerProcess]:
    yield from _server(tiny_llama, tmp_path_factory, "--enable-deterministic-inference")


@pytest.fixture(scope="module")
def plain_server(tiny_llama, tmp_path_factory) -> Iterator[ServerProcess]:
    yield from _server(tiny_llama, tmp_path_factory)


def _harness(capsys: pytest.CaptureFixture[str], url: str, mode: str, *extra: str) -> dict[str, tuple[int, int]]:
    rc = deterministic.main(["--base-url", url, "--mode", mode, "--n-trials", "6", "--max-tokens", "12", *extra])
    out = capsys.readouterr().out
    assert rc == 0, out
    counts = {label: (int(total), int(unique)) for label, total, unique in LINE.findall(out)}
    assert counts and sum(t for t, _ in counts.values()) >= 6, out
    return counts


SAMPLING = [[], ["--temperature", "0.7", "--seed", "42"]]


@pytest.mark.parametrize("mode", ["single", "mixed", "prefix"])
@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "t0.7-seed"])
def test_deterministic_server_gives_one_sample_per_prompt(det_server, capsys, mode, sampling) -> None:
    counts = _harness(capsys, det_server.base_url, mode, *sampling)
    assert all(unique == 1 for _, unique in counts.values()), counts


@pytest.mark.parametrize("mode", ["single", "mixed", "prefix"])
def test_without_the_flag_the_harness_sees_several_samples(plain_server, capsys, mode) -> None:
    """On this CPU every mode finds batch-dependent logprobs on the plain engine: its linears happen to be
    invariant for the tiny model's shapes (oneDNN), but SDPA prefill vs matmul decode, chunk boundaries and
    padded decode lengths change the attention sums."""
    counts = _harness(capsys, plain_server.base_url, mode, *SAMPLING[1])
    assert any(unique > 1 for _, unique in counts.values()), counts


def test_servelm_bench_deterministic_cli(det_server) -> None:
    """The real `servelm bench deterministic` command line."""
    proc = subprocess.run([sys.executable, "-m", "servelm", "bench", "deterministic", "--base-url",
                           det_server.base_url, "--mode", "single", "--n-trials", "3", "--max-tokens", "4"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Prompt 0 (single): Total samples: 3, Unique samples: 1" in proc.stdout
    assert "Deterministic: yes" in proc.stdout


def test_harness_reports_an_unreachable_server(capsys) -> None:
    assert deterministic.main(["--base-url", "http://127.0.0.1:9", "--n-trials", "1"]) == 1
    assert "error" in capsys.readouterr().out


def test_harness_help_lists_the_modes(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        deterministic.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert all(f"{m}  " in out for m in ("single", "mixed", "prefix")), out

