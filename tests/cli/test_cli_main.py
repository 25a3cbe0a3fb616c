"""`servelm` subcommands other than serve: version, backends, generate; top-level dispatch."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import servelm
from servelm.cli import serve_backends as sb
from servelm.cli.main import main
from servelm.cli.serve import CliError
from servelm.cli.serve_backends import ServeBackend, ServeBackendDetection, ServeBackendRegistry
from servelm.config import ServerArgs


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert capsys.readouterr().out == f"{servelm.__version__}\n"


def test_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 1
    assert capsys.readouterr().err == (
        "Error: Unknown command 'frobnicate'. Available commands: serve, generate, backends, bench, version.\n")


def test_top_level_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("serve", "generate", "backends", "version"):
        assert command in out
    assert main([]) == 1


def test_python_dash_m_entry_point() -> None:
    proc = subprocess.run([sys.executable, "-m", "servelm", "version"], capture_output=True, text=True)
    assert (proc.returncode, proc.stdout) == (0, f"{servelm.__version__}\n")


# ------------------------------------------------------------------ backends
class EP:
    def __init__(self, name: str, target: Any, dist: str) -> None:
        self.name, self.value, self.dist, self._target = name, f"{name}:f", SimpleNamespace(name=dist), target

    def load(self) -> Any:
        if isinstance(self._target, BaseException):
            raise self._target
        return self._target


def _backend(**kw: Any) -> ServeBackend:
    return ServeBackend(api_version=1, run=lambda r: None, **kw)


def test_backends_table(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    eps = [
        EP("good", lambda: _backend(detect=lambda r: ServeBackendDetection.UNKNOWN), "good-dist"),
        EP("broken", ModuleNotFoundError("No module named 'broken_pkg'"), "broken-dist"),
        EP("dup", lambda: _backend(), "z-dist"), EP("dup", lambda: _backend(), "a-dist"),
    ]
    monkeypatch.setattr(sb, "_default_registry", ServeBackendRegistry(entry_points=eps))
    assert main(["backends"]) == 0
    captured = capsys.readouterr()
    lines = [line.split() for line in captured.out.splitlines()]
    assert lines[0] == ["NAME", "PROVIDER", "API", "DETECTOR", "STATUS"]
    assert [row[0] for row in lines[1:]] == ["llm", "diffusion", "broken", "dup", "good"]
    rows = {row[0]: row for row in lines[1:]}
    assert rows["llm"][:5] == ["llm", "built-in", "1", "no", "ok:"] and "OpenAI API" in " ".join(rows["llm"])
    assert rows["diffusion"][:5] == ["diffusion", "built-in", "1", "yes", "ok:"]
    assert "OpenAI Images API" in " ".join(rows["diffusion"])
    assert rows["good"] == ["good", "good-dist", "1", "yes", "ok"]
    broken = captured.out.splitlines()[3]
    assert "broken-dist" in broken
    assert "error: Failed to load serve backend 'broken' from broken-dist: No module named 'broken_pkg'" in broken
    assert "Multiple distributions register serve backend 'dup': a-dist, z-dist" in captured.out
    assert "2 serve backend(s) failed to load: broken, dup" in captured.err


def test_backends_rejects_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--bogus"]) == 1
    assert capsys.readouterr().err.startswith("Error: servelm backends: unrecognized arguments")


# ------------------------------------------------------------------ generate
class FakeTokenizer:
    def apply_chat_template(self, messages: list[dict], tokenize: bool, add_generation_prompt: bool) -> str:
        assert tokenize is False and add_generation_prompt is True
        return f"<user>{messages[0]['content']}</user><assistant>"


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Stand-in for servelm.entrypoints.engine.Engine; records its life."""
    events: list[Any] = []

    class Engine:
        def __init__(self, server_args: Any) -> None:
            events.append(("init", server_args))
            self.tokenizer = FakeTokenizer()

        def generate(self, prompt: str, params: dict) -> dict:
            events.append(("generate", prompt, params))
            return {"text": "generated text", "meta_info": {}}

        def shutdown(self) -> None:
            events.append(("shutdown",))

    module = types.ModuleType("servelm.entrypoints.engine")
    module.Engine = Engine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "servelm.entrypoints.engine", module)
    monkeypatch.setattr(sb, "_default_registry", ServeBackendRegistry(entry_points=[]))
    return events


def test_generate_with_chat_template(fake_engine: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prompt", "Hi", "--max-new-tokens", "8", "--seed", "7", "--port", "31000"]) == 0
    assert capsys.readouterr().out == "generated text\n"
    (_, server_args), gen, shutdown = fake_engine
    assert server_args.model_path is None and server_args.port == 31000  # accepted, if unused
    # The KV pool is sized for the one request (the prompt's bytes bound its tokens), not a server's many.
    assert server_args.max_total_tokens == len("Hi") + 512 + 8
    assert gen == ("generate", "<user>Hi</user><assistant>", {"max_new_tokens": 8, "temperature": 0.0, "seed": 7})
    assert shutdown == ("shutdown",)


def test_generate_raw_defaults(fake_engine: list[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(16))  # passes the CLI's look at the path; the fake engine loads nothing
    assert main(["generate", "--model-path", str(model), "--prompt", "The sky is", "--raw"]) == 0
    assert capsys.readouterr().out == "generated text\n"
    assert fake_engine[0][1].model_path == str(model)
    assert fake_engine[1] == ("generate", "The sky is", {"max_new_tokens": 128, "temperature": 0.0, "seed": None})


def test_generate_shuts_engine_down_on_failure(fake_engine: list[Any], monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    engine_cls = sys.modules["servelm.entrypoints.engine"].Engine
    monkeypatch.setattr(engine_cls, "generate", lambda self, p, s: (_ for _ in ()).throw(ValueError("bad")))
    assert main(["generate", "--prompt", "x"]) == 1
    assert fake_engine[-1] == ("shutdown",)
    assert capsys.readouterr().err == "Error: ValueError: bad\n"


def test_generate_refuses_models_of_plugin_backends(fake_engine: list[Any], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    eps = [EP("mine", lambda: _backend(detect=lambda r: ServeBackendDetection.MATCH), "mine-dist")]
    monkeypatch.setattr(sb, "_default_registry", ServeBackendRegistry(entry_points=eps))
    assert main(["generate", "--model-path", str(tmp_path), "--prompt", "a cat"]) == 1
    assert capsys.readouterr().err == f"Error: Generate subcommand is not yet supported for model: {tmp_path}\n"
    assert fake_engine == []


def test_generate_routes_diffusers_folders_to_the_diffusion_backend(fake_engine: list[Any], tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_diffusers_version": "0.30.0"}))
    assert main(["generate", "--model-path", str(tmp_path), "--prompt", "a cat"]) == 1
    assert capsys.readouterr().err == (f"Error: {tmp_path} is not a diffusers pipeline folder: no model_index.json "
                                       "naming its pipeline class (_class_name)\n")
    assert fake_engine == []


def test_generate_requires_prompt(fake_engine: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate"]) == 1
    assert "the following arguments are required: --prompt" in capsys.readouterr().err
    assert fake_engine == []


def test_generate_help(fake_engine: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: servelm generate")
    for flag in ("--prompt", "--max-new-tokens", "--temperature", "--seed", "--raw", "--model-path", "--tp-size"):
        assert flag in out
    for flag in ("--port", "--host", "--api-key", "--max-queued-requests", "--shutdown-timeout"):
        assert flag not in out  # the HTTP server's, not generate's
    assert fake_engine == []


def test_vllm_flag_spellings_and_case_insensitive_levels() -> None:
    from servelm.backends.llm import build_parser

    def parse(*argv: str) -> ServerArgs:
        return ServerArgs.from_namespace(build_parser().parse_args(list(argv)))

    args = parse("--max-model-len", "512", "--tensor-parallel-size", "2", "--enable-prefix-caching",
                 "--disable-log-requests", "--log-level", "INFO", "--uvicorn-log-level", "Warning")
    assert (args.context_length, args.tp_size, args.disable_radix_cache, args.log_requests) == (512, 2, False, False)
    assert (args.log_level, args.uvicorn_log_level) == ("info", "warning")
    assert parse("--no-enable-prefix-caching").disable_radix_cache is True
    assert parse("--log-requests").log_requests is True


def test_misspelt_commands_and_flags_get_a_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serv"]) == 1
    assert "Unknown command 'serv'. Did you mean 'serve'?" in capsys.readouterr().err
    from servelm.backends.llm import build_parser

    with pytest.raises(CliError, match=r"unrecognized arguments: --max-tokenz 5 \(did you mean --max-total-tokens\?\)"):
        build_parser().parse_args(["--max-tokenz", "5"])
    with pytest.raises(CliError, match=r"unrecognized arguments: --zzzz$"):
        build_parser().parse_args(["--zzzz"])
