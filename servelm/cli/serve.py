"""`servelm serve`: argv normalisation, backend selection, and child-process cleanup.

The order of reading argv is part of the contract (docs/serve-backends.md):
`--model-type` is taken out first wherever it stands, then a leading
positional argument becomes `--model-path MODEL`, then the model path is read
from the flags or from a `--config` YAML file. Everything after that belongs
to the chosen backend, which parses its own argv.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import psutil

from servelm.cli.serve_backends import (
    HELP_FLAGS,  # noqa: F401  (re-exported with the two below: they moved to the plugin API module)
    CliError,
    ServeBackendRegistry,
    ServeRequest,
    StrictArgumentParser,  # noqa: F401
    default_registry,
    wants_help,
)
from servelm.config import ConfigError, load_config_file

logger = logging.getLogger(__name__)

AUTO = "auto"
MODEL_PATH_REQUIRED = "--model-path is required. Please provide the path to the model."
MODEL_PATH_FLAGS = ("--model-path", "--model")
MODEL_PATH_CONFIG_KEYS = ("model-path", "model_path", "model")

T = TypeVar("T")


def registry_call(fn: Callable[..., T], *args: Any) -> T:
    """Call into the registry, turning its errors into CliErrors that keep the original."""
    try:
        return fn(*args)
    except (ValueError, RuntimeError, TypeError) as exc:
        raise CliError(str(exc), original=exc) from exc


# ------------------------------------------------------------------ argv
def extract_model_type(argv: Sequence[str]) -> tuple[str, list[str]]:
    """Take every `--model-type X` / `--model-type=X` out of argv; the last one wins.

    The token after `--model-type` is its value even when it starts with `-`.
    Returns (model type, remaining argv); the model type defaults to `auto`.
    """
    model_type = AUTO
    rest: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--model-type":
            if i + 1 >= len(argv):
                raise CliError("--model-type requires a value.")
            value = argv[i + 1]
            i += 2
        elif token.startswith("--model-type="):
            value = token.partition("=")[2]
            i += 1
        else:
            rest.append(token)
            i += 1
            continue
        if not value:
            raise CliError("--model-type requires a non-empty value.")
        model_type = value
    return model_type, rest


def normalise_positional_model(argv: Sequence[str]) -> tuple[list[str], bool]:
    """Rewrite a leading positional MODEL as `--model-path MODEL`; say whether it did."""
    if argv and not argv[0].startswith("-"):
        return ["--model-path", argv[0], *argv[1:]], True
    return list(argv), False


def _flag_values(argv: Sequence[str], flags: Sequence[str]) -> list[str]:
    """Values of `--flag X` and `--flag=X` for any of `flags`, in argv order."""
    values: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, value = token.partition("=")
        if token in flags and i + 1 < len(argv):
            values.append(argv[i + 1])
            i += 2
            continue
        if eq and name in flags:
            values.append(value)
        i += 1
    return values


def model_path_from_config(config_path: str) -> str | None:
    """The model path in a `--config` YAML file (`model-path`, `model_path` or `model` key)."""
    data = load_config_file(config_path)
    for key in MODEL_PATH_CONFIG_KEYS:
        value = data.get(key)
        if value is not None and value != "":
            return str(value)
    return None


def model_path_from_argv(argv: Sequence[str]) -> str | None:
    """The model path from `--model-path`/`--model` (last wins), else from the `--config` file."""
    paths = _flag_values(argv, MODEL_PATH_FLAGS)
    if paths and paths[-1]:
        return paths[-1]
    configs = _flag_values(argv, ("--config",))
    if configs and configs[-1]:
        return model_path_from_config(configs[-1])
    return None


def build_request(argv: Sequence[str], *, strict_config: bool = True) -> ServeRequest:
    """The ServeRequest for argv that no longer holds `--model-type`.

    With `strict_config=False` an unreadable `--config` file leaves the model
    path unknown instead of failing (help must work whatever the file says).
    """
    normalised, positional = normalise_positional_model(argv)
    try:
        model_path = model_path_from_argv(normalised)
    except ConfigError:
        if strict_config:
            raise
        model_path = None
    return ServeRequest(argv=tuple(normalised), model_path=model_path, model_path_is_positional=positional)


# ------------------------------------------------------ child processes
def _identity(proc: psutil.Process) -> tuple[int, float] | None:
    try:
        return proc.pid, proc.create_time()
    except psutil.Error:
        return None


def terminate_descendants(
    exclude: set[tuple[int, float]] | frozenset[tuple[int, float]] = frozenset(), timeout: float = 3.0
) -> list[int]:
    """Terminate every descendant of this process not in `exclude`; kill those still alive after `timeout`.

    Returns the pids it signalled. `exclude` holds (pid, create_time) pairs so
    that a reused pid is never mistaken for a process that existed before.
    """
    try:
        descendants = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    targets = [p for p in descendants if _identity(p) is not None and _identity(p) not in exclude]
    for proc in targets:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(targets, timeout=timeout)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    if alive:
        psutil.wait_procs(alive, timeout=timeout)
    if targets:
        logger.info("Stopped %d child process(es) left by the backend", len(targets))
    return [p.pid for p in targets]


@contextlib.contextmanager
def reap_child_processes(timeout: float = 3.0) -> Iterator[None]:
    """On exit (normal or by any exception), terminate the descendants started inside the block.

    Processes that were already descendants when the block began are left
    alone: in the CLI there are none, and in-process callers (tests, embedding
    applications) keep their own children.
    """
    try:
        before = {ident for p in psutil.Process().children(recursive=True) if (ident := _identity(p))}
    except psutil.Error:
        before = set()
    try:
        yield
    finally:
        terminate_descendants(before, timeout=timeout)


@contextlib.contextmanager
def sigterm_raises_system_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit so that `finally` blocks (child cleanup) run on `kill`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ------------------------------------------------------------------ serve
def general_help(registry: ServeBackendRegistry) -> str:
    """Usage of `servelm serve` itself; lists backend names without importing any plugin."""
    names = ", ".join([AUTO, *registry.available_names()])
    return (
        "usage: servelm serve [MODEL] [--model-type TYPE] [backend arguments...]\n"
        "       servelm serve --model-type TYPE --help\n"
        "\n"
        "Start a server for MODEL (a folder, a .gguf file, or none for the embedded default model).\n"
        "\n"
        "options:\n"
        "  MODEL                 model path; same as --model-path MODEL\n"
        "  --model-type TYPE     serving backend (default: auto = detect from the model,\n"
        "                        falling back to llm)\n"
        f"                        available: {names}\n"
        "  -h, --help            this help, then the help of every built-in backend;\n"
        "                        with --model-type TYPE: that backend's help only\n"
    )


def print_general_help(registry: ServeBackendRegistry) -> None:
    """General help followed by every built-in backend's own help (no plugin is loaded)."""
    print(general_help(registry))
    for name in registry.builtin_names:
        backend = registry_call(registry.get, name)
        print(f"=== backend: {name} ===", flush=True)
        backend.run(ServeRequest(argv=("--help",)))
        print(flush=True)


def serve(argv: Sequence[str], registry: ServeBackendRegistry | None = None) -> None:
    """Run `servelm serve argv`: pick the backend and run it, then stop its child processes.

    Raises CliError/ConfigError for mistakes in the arguments or the registry.
    """
    model_type, rest = extract_model_type(argv)
    if registry is None:
        registry = registry_call(default_registry)

    if wants_help(rest):
        # Help never runs detection, never needs a model path, never touches processes.
        if model_type == AUTO:
            print_general_help(registry)
            return
        backend = registry_call(registry.get, model_type)
        backend.run(build_request(rest, strict_config=False))
        return

    request = build_request(rest)
    if model_type == AUTO:
        name = registry_call(registry.auto_detect, request)
        logger.info("Serve backend: %s (auto-detected)", name)
    else:
        name = model_type
    backend = registry_call(registry.get, name)
    if backend.requires_model_path and not request.model_path:
        raise CliError(MODEL_PATH_REQUIRED)
    sys.stdout.flush()
    # SIGTERM handling sits outside the reaper so that `kill <servelm>` still reaps.
    with sigterm_raises_system_exit(), reap_child_processes():
        backend.run(request)
