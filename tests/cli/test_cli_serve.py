"""`servelm serve`: argv rules, backend selection, help, error output, child cleanup."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from servelm.cli import serve_backends as sb
from servelm.cli.main import main
from servelm.cli.serve import (
    CliError,
    build_request,
    extract_model_type,
    model_path_from_argv,
    normalise_positional_model,
    reap_child_processes,
    serve,
)
from servelm.cli.serve_backends import (
    ServeBackend,
    ServeBackendDetection,
    ServeBackendRegistry,
    ServeRequest,
)

# ------------------------------------------------------------------ --model-type


@pytest.mark.parametrize(
    ("argv", "model_type", "rest"),
    [
        ([], "auto", []),
        (["m", "--tp", "2"], "auto", ["m", "--tp", "2"]),
        (["--model-type", "x", "m"], "x", ["m"]),
        (["m", "--model-type=x", "--port", "1"], "x", ["m", "--port", "1"]),
        (["--model-type", "a", "m", "--model-type=b", "--model-type", "c"], "c", ["m"]),  # last wins
        (["--model-type", "-weird", "m"], "-weird", ["m"]),  # the next token is the value, dash or not
        (["--model-type", "--help"], "--help", []),
        (["--model-type=a=b"], "a=b", []),
    ],
)
def test_extract_model_type(argv: list[str], model_type: str, rest: list[str]) -> None:
    assert extract_model_type(argv) == (model_type, rest)


def test_model_type_as_last_token_needs_a_value() -> None:
    with pytest.raises(CliError) as info:
        extract_model_type(["m", "--model-type", "llm", "--model-type"])
    assert str(info.value) == "--model-type requires a value."


@pytest.mark.parametrize("argv", [["--model-type="], ["m", "--model-type", ""], ["--model-type=", "--model-type=x"]])
def test_model_type_empty_value(argv: list[str]) -> None:
    with pytest.raises(CliError) as info:
        extract_model_type(argv)
    assert str(info.value) == "--model-type requires a non-empty value."


# ------------------------------------------------------------------ positional + model path
def test_positional_model_becomes_model_path() -> None:
    assert normalise_positional_model(["org/model", "--tp", "2"]) == (["--model-path", "org/model", "--tp", "2"], True)
    assert normalise_positional_model(["--tp", "2", "org/model"]) == (["--tp", "2", "org/model"], False)
    assert normalise_positional_model([]) == ([], False)


def test_build_request_after_model_type_removal() -> None:
    model_type, rest = extract_model_type(["--model-type", "x", "org/model", "--tp", "2"])
    request = build_request(rest)
    assert model_type == "x"
    assert request == ServeRequest(argv=("--model-path", "org/model", "--tp", "2"), model_path="org/model",
                                   model_path_is_positional=True)
    assert build_request(["--model", "m"]).model_path_is_positional is False


@pytest.mark.parametrize(
    ("argv", "path"),
    [
        (["--model-path", "a"], "a"),
        (["--model", "a"], "a"),
        (["--model-path=a"], "a"),
        (["--model=a"], "a"),
        (["--port", "1", "--model", "a", "--model-path=b"], "b"),
        (["--model-path"], None),  # dangling flag: the backend's parser will complain
        ([], None),
        (["--model-pathx", "a"], None),
    ],
)
def test_model_path_from_flags(argv: list[str], path: str | None) -> None:
    assert model_path_from_argv(argv) == path


@pytest.mark.parametrize("key", ["model-path", "model_path", "model"])
def test_model_path_from_config_keys(tmp_path: Path, key: str) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"port: 1234\n{key}: /from/yaml\n")
    assert model_path_from_argv(["--config", str(cfg)]) == "/from/yaml"
    assert model_path_from_argv([f"--config={cfg}"]) == "/from/yaml"


def test_cli_model_path_beats_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model_path: /from/yaml\n")
    assert model_path_from_argv(["--config", str(cfg), "--model-path", "/from/cli"]) == "/from/cli"
    assert build_request(["/positional", "--config", str(cfg)]).model_path == "/positional"


def test_config_without_model_key(tmp_path: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("port: 1234\n")
    assert model_path_from_argv(["--config", str(cfg)]) is None


# ------------------------------------------------------------------ serve() with a fake registry
class Recorder:
    """A backend whose calls are recorded."""

    def __init__(self, *, requires_model_path: bool = True, verdict: ServeBackendDetection | None = None,
                 action: Callable[[ServeRequest], None] | None = None) -> None:
        self.requests: list[ServeRequest] = []
        self.action = action
        detect = None if verdict is None else (lambda r: verdict)
        self.backend = ServeBackend(api_version=1, run=self.run, detect=detect,
                                    requires_model_path=requires_model_path)

    def run(self, request: ServeRequest) -> None:
        self.requests.append(request)
        if self.action is not None:
            self.action(request)


class EP:
    """Entry point stand-in; `loaded` tells whether anything imported it."""

    def __init__(self, name: str, target: Any, dist: str = "plugin-dist") -> None:
        self.name, self.value, self.dist, self._target, self.loaded = name, f"{name}:f", SimpleNamespace(name=dist), \
            target, False

    def load(self) -> Any:
        self.loaded = True
        if isinstance(self._target, BaseException):
            raise self._target
        return self._target


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A default registry of recorder backends: llm, diffusion built-ins and one plugin `mine`."""
    w = SimpleNamespace(llm=Recorder(requires_model_path=False),
                        diffusion=Recorder(verdict=ServeBackendDetection.NO_MATCH),
                        mine=Recorder(verdict=ServeBackendDetection.NO_MATCH))
    w.ep = EP("mine", lambda: w.mine.backend)
    w.registry = ServeBackendRegistry(builtins={"llm": lambda: w.llm.backend, "diffusion": lambda: w.diffusion.backend},
                                      entry_points=[w.ep])
    monkeypatch.setattr(sb, "_default_registry", w.registry)
    return w


def test_auto_falls_back_to_llm_without_model(world: SimpleNamespace) -> None:
    assert main(["serve", "--port", "1"]) == 0
    assert world.llm.requests == [ServeRequest(argv=("--port", "1"))]


def test_positional_model_is_passed_normalised(world: SimpleNamespace) -> None:
    assert main(["serve", "org/model", "--tp", "2"]) == 0
    assert world.llm.requests == [ServeRequest(argv=("--model-path", "org/model", "--tp", "2"),
                                               model_path="org/model", model_path_is_positional=True)]


def test_explicit_model_type_runs_only_that_backend(world: SimpleNamespace) -> None:
    assert main(["serve", "--model-type", "mine", "org/model", "--x", "1"]) == 0
    assert world.mine.requests == [ServeRequest(argv=("--model-path", "org/model", "--x", "1"),
                                                model_path="org/model", model_path_is_positional=True)]
    assert world.llm.requests == []


def test_explicit_builtin_does_not_load_plugins(world: SimpleNamespace) -> None:
    assert main(["serve", "--model-type=llm", "m"]) == 0
    assert len(world.llm.requests) == 1
    assert world.ep.loaded is False


def test_auto_detect_match_picks_backend(world: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    world.mine.backend = ServeBackend(api_version=1, run=world.mine.run, detect=lambda r: ServeBackendDetection.MATCH)
    assert main(["serve", "--model-path=/m"]) == 0
    assert [r.model_path for r in world.mine.requests] == ["/m"]
    assert world.llm.requests == []


def test_model_path_required(world: SimpleNamespace, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model-type", "mine", "--port", "1"]) == 1
    assert capsys.readouterr().err == "Error: --model-path is required. Please provide the path to the model.\n"
    assert world.mine.requests == []


def test_model_path_from_config_satisfies_requirement(world: SimpleNamespace, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model-path: /from/yaml\n")
    assert main(["serve", "--model-type", "mine", "--config", str(cfg)]) == 0
    assert world.mine.requests[0].model_path == "/from/yaml"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--model-type"], "Error: --model-type requires a value.\n"),
        (["serve", "m", "--model-type="], "Error: --model-type requires a non-empty value.\n"),
        (["serve", "--model-type", "nope"],
         "Error: Unknown serve backend 'nope'. Available values: auto, llm, diffusion, mine.\n"),
        (["serve", "--model-type", "nope", "--help"],
         "Error: Unknown serve backend 'nope'. Available values: auto, llm, diffusion, mine.\n"),
    ],
)
def test_argument_errors_print_one_line(world: SimpleNamespace, capsys: pytest.CaptureFixture[str],
                                        argv: list[str], message: str) -> None:
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert captured.err == message
    assert "Traceback" not in captured.err


def test_load_failure_prints_caused_by_chain(world: SimpleNamespace, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        try:
            raise OSError("libfoo.so: cannot open shared object file")
        except OSError as inner:
            raise ImportError("cannot import name 'Engine' from 'my_pkg'") from inner
    except ImportError as exc:
        world.ep._target = exc
    assert main(["serve", "--model-type", "mine", "m"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "Error: Failed to load serve backend 'mine' from plugin-dist: cannot import name 'Engine' from 'my_pkg'",
        "  caused by: ImportError: cannot import name 'Engine' from 'my_pkg'",
        "  caused by: OSError: libfoo.so: cannot open shared object file",
    ]


def test_debug_env_shows_traceback(world: SimpleNamespace, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    world.ep._target = ImportError("nope")
    monkeypatch.setenv("SERVELM_DEBUG", "1")
    assert main(["serve", "--model-type", "mine", "m"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert "Error: Failed to load serve backend 'mine' from plugin-dist: nope" in err


def test_auto_detect_with_broken_plugin_still_serves_llm(world: SimpleNamespace,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    world.ep._target = ImportError("plugin is broken")
    assert main(["serve", "m"]) == 0
    assert len(world.llm.requests) == 1


def test_multiple_matches_error(world: SimpleNamespace, capsys: pytest.CaptureFixture[str]) -> None:
    match = lambda r: ServeBackendDetection.MATCH  # noqa: E731
    world.mine.backend = ServeBackend(api_version=1, run=world.mine.run, detect=match)
    world.diffusion.backend = ServeBackend(api_version=1, run=world.diffusion.run, detect=match)
    assert main(["serve", "m"]) == 1
    assert capsys.readouterr().err == ("Error: Multiple serve backends matched this request: diffusion, mine. "
                                       "Select one explicitly with --model-type BACKEND.\n")


def test_registry_construction_error_is_reported(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sb, "_default_registry", None)
    monkeypatch.setattr(sb, "discover_entry_points", lambda group=sb.ENTRY_POINT_GROUP: [EP("llm", None)])
    assert main(["serve", "m"]) == 1
    assert capsys.readouterr().err == (
        "Error: Out-of-tree serve backends cannot replace reserved or built-in backends: llm\n")


# ------------------------------------------------------------------ help
def test_general_help_lists_names_and_builtin_helps_without_loading_plugins(
    world: SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: servelm serve")
    assert "--model-type" in out and "auto, llm, diffusion, mine" in out
    assert world.llm.requests == [ServeRequest(argv=("--help",))]
    assert world.diffusion.requests == [ServeRequest(argv=("--help",))]
    assert world.mine.requests == [] and world.ep.loaded is False


def test_general_help_with_positional_and_explicit_auto(world: SimpleNamespace) -> None:
    assert main(["serve", "org/m", "--model-type", "auto", "-h"]) == 0
    assert len(world.llm.requests) == 1 and world.ep.loaded is False


def test_targeted_help_loads_only_that_backend(world: SimpleNamespace, tmp_path: Path) -> None:
    assert main(["serve", "--model-type", "mine", "--help", "--config", str(tmp_path / "missing.yaml")]) == 0
    assert [r.argv for r in world.mine.requests] == [("--help", "--config", str(tmp_path / "missing.yaml"))]
    assert world.llm.requests == [] and world.diffusion.requests == []


def test_targeted_help_needs_no_model_path_and_runs_no_detection(world: SimpleNamespace) -> None:
    world.mine.backend = ServeBackend(api_version=1, run=world.mine.run,
                                      detect=lambda r: pytest.fail("help must not detect"))
    assert main(["serve", "--model-type", "mine", "-h"]) == 0
    assert len(world.mine.requests) == 1


def test_help_does_not_touch_processes(world: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    import servelm.cli.serve as serve_mod

    monkeypatch.setattr(serve_mod, "terminate_descendants", lambda *a, **k: pytest.fail("help reaped processes"))
    assert main(["serve", "--help"]) == 0
    assert main(["serve", "--model-type", "mine", "--help"]) == 0


def test_real_builtin_help_end_to_end(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sb, "_default_registry", ServeBackendRegistry(entry_points=[]))
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    assert "=== backend: llm ===" in out and "=== backend: diffusion ===" in out
    assert "--chunked-prefill-size" in out and "/v1/images/generations" in out


# ------------------------------------------------------------------ child process cleanup
def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_leftovers(pids: list[int]) -> None:
    # Only matters when the feature is broken: never leave sleepers behind the test run.
    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass


def _spawn_sleeper(pids: list[int]) -> Callable[[ServeRequest], None]:
    def action(request: ServeRequest) -> None:
        pids.append(subprocess.Popen(["sleep", "300"]).pid)
    return action


def _raise(exc: BaseException) -> Callable[[ServeRequest], None]:
    def action(request: ServeRequest) -> None:
        raise exc
    return action


@pytest.mark.parametrize(
    ("then", "code"),
    [(None, 0), (RuntimeError("backend crashed"), 1), (KeyboardInterrupt(), 130), (SystemExit(3), 3)],
)
def test_children_are_terminated_after_run(world: SimpleNamespace, then: BaseException | None, code: int) -> None:
    pids: list[int] = []
    spawn = _spawn_sleeper(pids)

    def action(request: ServeRequest) -> None:
        spawn(request)
        if then is not None:
            raise then

    world.llm.action = action
    keep = subprocess.Popen(["sleep", "300"])  # existed before serve: not the serve command's child
    try:
        assert main(["serve"]) == code
        assert len(pids) == 1 and not _alive(pids[0])
        assert _alive(keep.pid)
    finally:
        keep.kill()
        keep.wait()
        _kill_leftovers(pids)


def test_grandchildren_and_term_ignoring_children_are_killed() -> None:
    script = "import signal, subprocess, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
             "p = subprocess.Popen(['sleep', '300']); print(p.pid, flush=True); time.sleep(300)"
    start = time.monotonic()
    with reap_child_processes(timeout=0.5):
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        grandchild = int(child.stdout.readline())
    try:
        assert not _alive(child.pid) and not _alive(grandchild)
    finally:
        _kill_leftovers([grandchild, child.pid])
        child.stdout.close()
        child.wait()
    assert time.monotonic() - start < 10


def test_serve_raises_cli_error_directly() -> None:
    reg = ServeBackendRegistry(builtins={"llm": lambda: Recorder().backend}, entry_points=[])
    with pytest.raises(CliError, match="--model-path is required"):
        serve(["--model-type", "llm"], registry=reg)
