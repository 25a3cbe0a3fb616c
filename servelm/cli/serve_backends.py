"""The serve-backend registry: which runtime answers `servelm serve`.

A backend is a `ServeBackend` value returned by a zero-argument factory.
Built-in factories are registered in code (`BUILTIN_BACKENDS`); out-of-tree
ones are installed packages that declare an entry point in the
`servelm.serve_backends` group, whose name is the `--model-type` value.

Importing this module starts no runtime and imports no out-of-tree backend:
the registry discovers entry points from package metadata only and imports a
provider the first time `get()` asks for it by name.
"""

from __future__ import annotations

import argparse
import difflib
import enum
import importlib
import importlib.metadata
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

HELP_FLAGS = ("-h", "--help")


# What a backend needs to read its own argv (the backends import these from here, not from cli/serve.py).
class CliError(Exception):
    """A mistake the user can fix; printed as `Error: <message>`, exit code 1, no traceback.

    `original` keeps the registry exception this wraps, so that the printer can
    follow its `__cause__` chain (`caused by:` lines) and the debug traceback
    shows where it really came from.
    """

    def __init__(self, message: str, original: BaseException | None = None) -> None:
        super().__init__(message)
        self.original = original


class StrictArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise CliError instead of printing usage and exiting 2."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{self.prog}: {message}{self._suggestions(message)}")

    def _suggestions(self, message: str) -> str:
        """` (did you mean --x?)` for misspelt flags in an "unrecognized arguments" message."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        known = [name for action in self._actions for name in action.option_strings if name.startswith("--")]
        hints = []
        for token in message.partition(":")[2].split():
            flag = token.partition("=")[0]
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.7) if flag.startswith("--") else []
            if close:
                hints.append(close[0])
        return f" (did you mean {', '.join(hints)}?)" if hints else ""


def wants_help(argv: Sequence[str]) -> bool:
    """True when argv asks for help (`-h` or `--help` anywhere)."""
    return any(tok in HELP_FLAGS for tok in argv)


logger = logging.getLogger(__name__)

SERVE_BACKEND_API_VERSION = 1
"""The plugin API version this release speaks; a backend must declare exactly this."""

ENTRY_POINT_GROUP = "servelm.serve_backends"
RESERVED_NAMES: frozenset[str] = frozenset({"auto"})
BUILTIN_PROVIDER = "built-in"
FALLBACK_BACKEND = "llm"

# Built-ins, in the order users see them. Values are "module:attribute" so that
# building the registry imports none of them.
BUILTIN_BACKENDS: dict[str, str] = {
    "llm": "servelm.backends.llm:create_backend",
    "diffusion": "servelm.backends.diffusion:create_backend",
}


class ServeBackendDetection(enum.Enum):
    """A detector's verdict on whether its backend should serve a request."""

    MATCH = "match"
    NO_MATCH = "no_match"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class ServeRequest:
    """What `servelm serve` hands a backend.

    `argv` is normalised: `--model-type` is removed and a positional model is
    rewritten as `--model-path MODEL`. `model_path` is what the front end could
    read from argv or from a `--config` file (None when absent).
    """

    argv: tuple[str, ...]
    model_path: str | None = None
    model_path_is_positional: bool = False


@dataclass(frozen=True)
class ServeBackend:
    """A serving runtime.

    `run(request)` parses `request.argv` itself, prints its help and returns on
    `-h/--help`, and otherwise blocks for the server's lifetime. `detect`, when
    given, must be cheap (no accelerator init, no heavy imports) and answer
    UNKNOWN when unsure.
    """

    api_version: int
    run: Callable[[ServeRequest], None]
    detect: Callable[[ServeRequest], ServeBackendDetection] | None = None
    requires_model_path: bool = True
    summary: str = ""  # what it can serve, one line, for `servelm backends` (optional)


def _names(names: Iterable[str]) -> str:
    return ", ".join(sorted(names))


def _cause_text(exc: BaseException) -> str:
    text = str(exc).strip()
    return text if text else type(exc).__name__


@dataclass(frozen=True)
class _Provider:
    """One source of a backend: a built-in factory path or an entry point."""

    name: str
    distribution: str
    load: Callable[[], Any]


def _entry_point_distribution(ep: Any) -> str:
    dist = getattr(ep, "dist", None)
    name = getattr(dist, "name", None) if dist is not None else None
    return name or f"unknown distribution ({getattr(ep, 'value', '?')})"


def _import_target(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj


def discover_entry_points(group: str = ENTRY_POINT_GROUP) -> list[Any]:
    """Installed entry points of `group`, read from metadata (nothing is imported)."""
    return list(importlib.metadata.entry_points(group=group))


class ServeBackendRegistry:
    """Built-in and installed serve backends, loaded lazily and cached.

    `builtins` maps name -> "module:attr" of a factory, or the factory itself
    (tests pass callables). `entry_points` defaults to the installed entry
    points of `servelm.serve_backends`; anything with `name`, `value`, `dist`
    and `load()` will do.
    """

    def __init__(
        self,
        builtins: Mapping[str, str | Callable[[], Any]] | None = None,
        entry_points: Iterable[Any] | None = None,
    ) -> None:
        builtins = dict(BUILTIN_BACKENDS if builtins is None else builtins)
        reserved_builtins = RESERVED_NAMES & builtins.keys()
        if reserved_builtins:
            raise ValueError(f"Reserved serve backend names cannot be used: {_names(reserved_builtins)}")
        eps = discover_entry_points() if entry_points is None else list(entry_points)
        clashes = {ep.name for ep in eps if ep.name in builtins or ep.name in RESERVED_NAMES}
        if clashes:
            raise RuntimeError(
                f"Out-of-tree serve backends cannot replace reserved or built-in backends: {_names(clashes)}"
            )

        self._builtin_names: tuple[str, ...] = tuple(builtins)
        self._providers: dict[str, list[_Provider]] = {}
        for name, target in builtins.items():
            load = (lambda t=target: _import_target(t)) if isinstance(target, str) else (lambda t=target: t)
            self._providers[name] = [_Provider(name, BUILTIN_PROVIDER, load)]
        seen: set[tuple[str, str, str]] = set()
        for ep in eps:
            dist = _entry_point_distribution(ep)
            # The same distribution visible twice on sys.path is one provider, not a conflict.
            key = (ep.name, dist, getattr(ep, "value", ""))
            if key in seen:
                continue
            seen.add(key)
            self._providers.setdefault(ep.name, []).append(_Provider(ep.name, dist, ep.load))
        self._cache: dict[str, ServeBackend | BaseException] = {}

    # ------------------------------------------------------------- queries
    @property
    def builtin_names(self) -> tuple[str, ...]:
        """Built-in backend names, in registration order."""
        return self._builtin_names

    def available_names(self) -> list[str]:
        """Built-ins in order, then out-of-tree names sorted. Imports nothing."""
        plugins = sorted(n for n in self._providers if n not in self._builtin_names)
        return [*self._builtin_names, *plugins]

    def provider(self, name: str) -> str:
        """`built-in`, the distribution name, or several sorted names for a conflict."""
        providers = self._providers.get(name)
        if not providers:
            raise self._unknown(name)
        return _names(p.distribution for p in providers)

    # ------------------------------------------------------------- loading
    def _unknown(self, name: str) -> ValueError:
        values = ", ".join(["auto", *self.available_names()])
        return ValueError(f"Unknown serve backend '{name}'. Available values: {values}.")

    def get(self, name: str) -> ServeBackend:
        """Import, build and validate backend `name` (once; the outcome is cached)."""
        cached = self._cache.get(name)
        if isinstance(cached, ServeBackend):
            return cached
        if cached is not None:
            raise cached
        try:
            backend = self._load(name)
        except (ValueError, RuntimeError, TypeError) as exc:
            # Unknown names are not cached: they cost nothing to recompute.
            if name in self._providers:
                self._cache[name] = exc
            raise
        self._cache[name] = backend
        return backend

    def _load(self, name: str) -> ServeBackend:
        providers = self._providers.get(name)
        if not providers:
            raise self._unknown(name)
        if len(providers) > 1:
            raise RuntimeError(
                f"Multiple distributions register serve backend '{name}': "
                f"{_names(p.distribution for p in providers)}. "
                "Uninstall one provider or choose another backend name."
            )
        provider = providers[0]
        try:
            factory = provider.load()
            if not callable(factory):
                raise TypeError("the entry point must resolve to a callable factory")
            backend = factory()
        except Exception as exc:
            raise RuntimeError(
                f"Failed to load serve backend '{name}' from {provider.distribution}: {_cause_text(exc)}"
            ) from exc
        if not isinstance(backend, ServeBackend):
            raise TypeError(
                f"Serve backend '{name}' factory returned {type(backend).__name__}; "
                "expected servelm.cli.serve_backends.ServeBackend."
            )
        if backend.api_version != SERVE_BACKEND_API_VERSION:
            raise RuntimeError(
                f"Serve backend '{name}' uses API version {backend.api_version}; "
                f"this servelm release requires version {SERVE_BACKEND_API_VERSION}."
            )
        return backend

    # ----------------------------------------------------------- detection
    def auto_detect(self, request: ServeRequest) -> str:
        """Name of the backend that should serve `request` when `--model-type auto`.

        Every backend but the `llm` fallback is loaded and asked; one that fails
        to load or detect is skipped with a warning, so a broken plugin can never
        block the fallback.
        """
        matches: list[str] = []
        for name in self.available_names():
            if name == FALLBACK_BACKEND:
                continue
            try:
                backend = self.get(name)
            except Exception as exc:
                logger.warning("Skipping serve backend '%s' during auto-detection: %s", name, exc)
                continue
            if backend.detect is None:
                continue
            try:
                verdict = backend.detect(request)
            except Exception as exc:
                logger.warning("Serve backend '%s' detector failed; skipping it: %s", name, _cause_text(exc))
                continue
            if not isinstance(verdict, ServeBackendDetection):
                logger.warning(
                    "Serve backend '%s' detector returned %s instead of a ServeBackendDetection; skipping it",
                    name, type(verdict).__name__,
                )
                continue
            if verdict is ServeBackendDetection.MATCH:
                matches.append(name)
        if len(matches) > 1:
            raise RuntimeError(
                f"Multiple serve backends matched this request: {_names(matches)}. "
                "Select one explicitly with --model-type BACKEND."
            )
        return matches[0] if matches else FALLBACK_BACKEND


_default_registry: ServeBackendRegistry | None = None


def default_registry() -> ServeBackendRegistry:
    """The process-wide registry over the built-ins and the installed entry points."""
    global _default_registry
    if _default_registry is None:
        _default_registry = ServeBackendRegistry()
    return _default_registry


def available_names() -> list[str]:
    """Built-in names in order, then installed plugin names sorted; imports nothing."""
    return default_registry().available_names()


def get(name: str) -> ServeBackend:
    """Load (once) and return the backend registered as `name`."""
    return default_registry().get(name)


def auto_detect(request: ServeRequest) -> str:
    """Name of the backend `--model-type auto` picks for `request` (fallback `llm`)."""
    return default_registry().auto_detect(request)
