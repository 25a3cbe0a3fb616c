"""A model path that cannot work, or a port in use, fails at once from the CLI: one `Error:` line, no traceback,
before any process starts or the model loads; a model that fails only while loading still gives one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from servelm.model_loader.model_path import ModelSourceError, check_model_path
from tests.server_fixtures import free_port

pytestmark = pytest.mark.slow  # starts servers, spawns ranks or loads the default model

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_cli(*argv: str, timeout: float = 180) -> tuple[int, str]:
    """`servelm argv` in a fresh interpreter; returns (exit code, combined output + whether torch loaded)."""
    code = ("import sys\nfrom servelm.cli.main import main\nrc = main(sys.argv[1:])\n"
            "print('torch loaded:', 'torch' in sys.modules)\nsys.exit(rc)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("SERVELM_DEBUG", None)
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO_ROOT, env=env)
    return proc.returncode, proc.stdout + proc.stderr


def bad_paths(tmp_path: Path) -> dict[str, tuple[str, str]]:
    (tmp_path / "noconfig").mkdir()
    (tmp_path / "random.gguf").write_bytes(os.urandom(4096))
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "config.json").write_text("{not json")
    return {
        "missing": (str(tmp_path / "nonexistent"), "does not exist"),
        "hub id": ("Qwen/Qwen2-0.5B-Instruct", "looks like a Hugging Face Hub id"),
        "no config": (str(tmp_path / "noconfig"), "has no config.json and no .gguf file"),
        "random gguf": (str(tmp_path / "random.gguf"), "is not a GGUF file"),
        "no weights": (str(tmp_path / "noweights"), "has no model.safetensors"),
        "architecture": (str(tmp_path / "gpt2"), "Unsupported model architecture 'GPT2LMHeadModel'"),
        "bad json": (str(tmp_path / "badjson"), "Cannot read"),
    }


def test_check_model_path(tmp_path: Path, tiny_llama: tuple[Path, object]) -> None:
    for name, (path, message) in bad_paths(tmp_path).items():
        with pytest.raises(ModelSourceError, match=message):
            check_model_path(path)
        assert name
    assert check_model_path(str(tiny_llama[0])) == (str(tiny_llama[0]), "hf")


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_bad_model_path_is_one_line_before_torch(tmp_path: Path, command: str) -> None:
    for path, message in bad_paths(tmp_path).values():
        extra = ["--prompt", "hi"] if command == "generate" else []
        rc, out = run_cli(command, path, *extra)
        assert rc == 1, out
        errors = [line for line in out.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and message in errors[0], out
        assert "Traceback" not in out and "torch loaded: False" in out, out
        assert "Uvicorn running" not in out and "Loading model" not in out, out


def test_model_that_fails_while_loading_logs_no_traceback(tmp_path: Path) -> None:
    """A GGUF with the right magic bytes but nothing valid after them gets past the CLI check."""
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + os.urandom(2048))
    rc, out = run_cli("serve", str(broken), "--port", str(free_port()), "--disable-torch-compile")
    assert rc == 1, out
    assert "Traceback" not in out and "never retrieved" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Cannot read GGUF file" in errors[0] and "ServerError" not in errors[0], out


def test_port_in_use_is_one_line_before_the_model_loads(tiny_llama: tuple[Path, object]) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        rc, out = run_cli("serve", str(tiny_llama[0]), "--port", str(port))
    assert rc == 1, out
    errors = [line for line in out.splitlines() if line.startswith("Error:")]
    assert errors == [f"Error: Port {port} on 127.0.0.1 is already in use (another server?): stop it or pass "
                      "another --port"], out
    assert "Traceback" not in out and "Loading model" not in out, out
