"""Registry rules of docs/serve-backends.md, with fake entry points (no installs)."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from servelm.cli import serve_backends as sb
from servelm.cli.serve_backends import (
    SERVE_BACKEND_API_VERSION,
    ServeBackend,
    ServeBackendDetection,
    ServeBackendRegistry,
    ServeRequest,
)


def _noop_run(request: ServeRequest) -> None:
    return None


def make_backend(detect: Callable[[ServeRequest], Any] | None = None, **kw: Any) -> ServeBackend:
    return ServeBackend(api_version=kw.pop("api_version", SERVE_BACKEND_API_VERSION), run=_noop_run,
                        detect=detect, **kw)


@dataclass
class FakeEntryPoint:
    """Quacks like importlib.metadata.EntryPoint; counts loads."""

    name: str
    target: Any = None
    dist_name: str | None = "fake-dist"
    error: BaseException | None = None
    value: str = ""
    group: str = sb.ENTRY_POINT_GROUP
    loads: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.value = self.value or f"{self.dist_name}.mod:factory"

    @property
    def dist(self) -> Any:
        return None if self.dist_name is None else SimpleNamespace(name=self.dist_name)

    def load(self) -> Any:
        self.loads.append(1)
        if self.error is not None:
            raise self.error
        return self.target


def factory_of(backend: Any) -> Callable[[], Any]:
    return lambda: backend


BUILTINS = {"llm": factory_of(make_backend(requires_model_path=False)), "diffusion": factory_of(make_backend())}


def registry(*eps: FakeEntryPoint, builtins: dict | None = None) -> ServeBackendRegistry:
    return ServeBackendRegistry(builtins=BUILTINS if builtins is None else builtins, entry_points=list(eps))


# ------------------------------------------------------------ constants
def test_contract_constants() -> None:
    assert SERVE_BACKEND_API_VERSION == 1
    assert sb.RESERVED_NAMES == frozenset({"auto"})
    assert sb.ENTRY_POINT_GROUP == "servelm.serve_backends"
    assert list(sb.BUILTIN_BACKENDS) == ["llm", "diffusion"]
    assert {d.name for d in ServeBackendDetection} == {"MATCH", "NO_MATCH", "UNKNOWN"}


def test_request_and_backend_are_frozen_with_defaults() -> None:
    request = ServeRequest(argv=("--port", "1"))
    assert request.model_path is None and request.model_path_is_positional is False
    with pytest.raises(AttributeError):
        request.model_path = "x"  # type: ignore[misc]
    backend = ServeBackend(api_version=1, run=_noop_run)
    assert backend.detect is None and backend.requires_model_path is True
    with pytest.raises(AttributeError):
        backend.api_version = 2  # type: ignore[misc]


def test_importing_the_module_starts_nothing_and_loads_no_backend() -> None:
    code = (
        "import sys, servelm.cli.serve_backends as sb\n"
        "r = sb.ServeBackendRegistry()\n"
        "names = r.available_names()\n"
        "bad = [m for m in ('servelm.backends.llm', 'servelm.backends.diffusion', 'torch', 'diffusers') "
        "if m in sys.modules]\n"
        "print(names[:2], bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['llm', 'diffusion'] []"


# ------------------------------------------------------------ construction
def test_builtin_with_reserved_name_is_a_value_error() -> None:
    with pytest.raises(ValueError) as info:
        registry(builtins={"auto": factory_of(make_backend()), "llm": factory_of(make_backend())})
    assert str(info.value) == "Reserved serve backend names cannot be used: auto"


def test_plugin_may_not_replace_builtin_or_reserved_names() -> None:
    eps = [FakeEntryPoint("llm"), FakeEntryPoint("auto"), FakeEntryPoint("diffusion"), FakeEntryPoint("ok")]
    with pytest.raises(RuntimeError) as info:
        registry(*eps)
    assert str(info.value) == (
        "Out-of-tree serve backends cannot replace reserved or built-in backends: auto, diffusion, llm"
    )


def test_construction_imports_no_entry_point() -> None:
    ep = FakeEntryPoint("zeta", target=factory_of(make_backend()))
    reg = registry(ep)
    assert reg.available_names() == ["llm", "diffusion", "zeta"]
    assert ep.loads == []


def test_available_names_builtins_in_order_then_plugins_sorted_once() -> None:
    eps = [FakeEntryPoint("zeta"), FakeEntryPoint("alpha"), FakeEntryPoint("mid", dist_name="a"),
           FakeEntryPoint("mid", dist_name="b")]
    reg = registry(*eps)
    assert reg.available_names() == ["llm", "diffusion", "alpha", "mid", "zeta"]
    assert reg.builtin_names == ("llm", "diffusion")
    assert all(ep.loads == [] for ep in eps)


def test_provider_is_builtin_or_distribution_name() -> None:
    reg = registry(FakeEntryPoint("mine", dist_name="my-dist"),
                   FakeEntryPoint("dup", dist_name="zz"), FakeEntryPoint("dup", dist_name="aa"))
    assert reg.provider("llm") == "built-in"
    assert reg.provider("mine") == "my-dist"
    assert reg.provider("dup") == "aa, zz"


# ------------------------------------------------------------ get
def test_unknown_name_without_plugins() -> None:
    with pytest.raises(ValueError) as info:
        registry().get("nope")
    assert str(info.value) == "Unknown serve backend 'nope'. Available values: auto, llm, diffusion."


def test_unknown_name_lists_plugins_sorted() -> None:
    reg = registry(FakeEntryPoint("zz"), FakeEntryPoint("aa"))
    with pytest.raises(ValueError) as info:
        reg.get("auto")
    assert str(info.value) == "Unknown serve backend 'auto'. Available values: auto, llm, diffusion, aa, zz."


def test_get_loads_only_the_requested_plugin_once() -> None:
    calls: list[str] = []
    backend = make_backend()

    def factory() -> ServeBackend:
        calls.append("mine")
        return backend

    mine = FakeEntryPoint("mine", target=factory)
    other = FakeEntryPoint("other", target=factory_of(make_backend()))
    reg = registry(mine, other)
    assert reg.get("mine") is backend
    assert reg.get("mine") is backend
    assert mine.loads == [1] and calls == ["mine"]
    assert other.loads == []


def test_get_builtin_by_import_path() -> None:
    reg = ServeBackendRegistry(entry_points=[])
    llm = reg.get("llm")
    assert isinstance(llm, ServeBackend)
    assert llm.requires_model_path is False and llm.detect is None
    assert reg.get("diffusion").detect is not None


def test_duplicate_across_distributions_lists_providers_sorted() -> None:
    eps = [FakeEntryPoint("dup", dist_name="zeta-dist", target=factory_of(make_backend())),
           FakeEntryPoint("dup", dist_name="alpha-dist", target=factory_of(make_backend()))]
    with pytest.raises(RuntimeError) as info:
        registry(*eps).get("dup")
    assert str(info.value) == (
        "Multiple distributions register serve backend 'dup': alpha-dist, zeta-dist. "
        "Uninstall one provider or choose another backend name."
    )
    assert all(ep.loads == [] for ep in eps)


def test_same_distribution_seen_twice_is_not_a_conflict() -> None:
    backend = make_backend()
    a = FakeEntryPoint("dup", dist_name="d", value="d.mod:f", target=factory_of(backend))
    b = FakeEntryPoint("dup", dist_name="d", value="d.mod:f", target=factory_of(backend))
    assert registry(a, b).get("dup") is backend


def test_load_failure_names_plugin_and_distribution_and_chains_cause() -> None:
    cause = ModuleNotFoundError("No module named 'my_pkg'")
    reg = registry(FakeEntryPoint("mine", dist_name="my-dist", error=cause))
    with pytest.raises(RuntimeError) as info:
        reg.get("mine")
    assert str(info.value) == "Failed to load serve backend 'mine' from my-dist: No module named 'my_pkg'"
    assert info.value.__cause__ is cause


def test_failure_is_cached_not_retried() -> None:
    ep = FakeEntryPoint("mine", error=ImportError("boom"))
    reg = registry(ep)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="boom"):
            reg.get("mine")
    assert ep.loads == [1]


def test_non_callable_target() -> None:
    reg = registry(FakeEntryPoint("mine", dist_name="my-dist", target=42))
    with pytest.raises(RuntimeError) as info:
        reg.get("mine")
    assert str(info.value) == (
        "Failed to load serve backend 'mine' from my-dist: the entry point must resolve to a callable factory"
    )
    assert isinstance(info.value.__cause__, TypeError)


def test_factory_raising() -> None:
    cause = OSError("no accelerator here")

    def factory() -> ServeBackend:
        raise cause

    reg = registry(FakeEntryPoint("mine", dist_name="my-dist", target=factory))
    with pytest.raises(RuntimeError) as info:
        reg.get("mine")
    assert str(info.value) == "Failed to load serve backend 'mine' from my-dist: no accelerator here"
    assert info.value.__cause__ is cause


def test_factory_returning_wrong_type() -> None:
    reg = registry(FakeEntryPoint("mine", target=factory_of({"run": _noop_run})))
    with pytest.raises(TypeError) as info:
        reg.get("mine")
    assert str(info.value) == (
        "Serve backend 'mine' factory returned dict; expected servelm.cli.serve_backends.ServeBackend."
    )


def test_wrong_api_version() -> None:
    reg = registry(FakeEntryPoint("mine", target=factory_of(make_backend(api_version=2))))
    with pytest.raises(RuntimeError) as info:
        reg.get("mine")
    assert str(info.value) == "Serve backend 'mine' uses API version 2; this servelm release requires version 1."


def test_broken_builtin_reports_built_in_provider() -> None:
    reg = ServeBackendRegistry(builtins={"llm": "servelm_no_such_module:create"}, entry_points=[])
    with pytest.raises(RuntimeError, match=r"^Failed to load serve backend 'llm' from built-in: No module named"):
        reg.get("llm")


# ------------------------------------------------------------ auto_detect
def ep_with_detector(name: str, detect: Callable[[ServeRequest], Any]) -> FakeEntryPoint:
    return FakeEntryPoint(name, dist_name=f"{name}-dist", target=factory_of(make_backend(detect=detect)))


REQ = ServeRequest(argv=("--model-path", "/m"), model_path="/m")


def test_auto_detect_falls_back_to_llm() -> None:
    reg = registry(ep_with_detector("a", lambda r: ServeBackendDetection.NO_MATCH),
                   ep_with_detector("b", lambda r: ServeBackendDetection.UNKNOWN),
                   FakeEntryPoint("c", target=factory_of(make_backend())))  # no detector at all
    assert reg.auto_detect(REQ) == "llm"


def test_auto_detect_single_match_wins_and_receives_the_request() -> None:
    seen: list[ServeRequest] = []

    def detect(request: ServeRequest) -> ServeBackendDetection:
        seen.append(request)
        return ServeBackendDetection.MATCH

    reg = registry(ep_with_detector("mine", detect), ep_with_detector("b", lambda r: ServeBackendDetection.NO_MATCH))
    assert reg.auto_detect(REQ) == "mine"
    assert seen == [REQ]


def test_auto_detect_never_asks_llm() -> None:
    asked: list[str] = []
    builtins = {
        "llm": factory_of(make_backend(detect=lambda r: asked.append("llm") or ServeBackendDetection.MATCH)),
        "diffusion": factory_of(make_backend(detect=lambda r: asked.append("diffusion")
                                              or ServeBackendDetection.NO_MATCH)),
    }
    assert registry(builtins=builtins).auto_detect(REQ) == "llm"
    assert asked == ["diffusion"]


def test_auto_detect_multiple_matches_is_an_error() -> None:
    match = lambda r: ServeBackendDetection.MATCH  # noqa: E731
    builtins = {"llm": BUILTINS["llm"], "diffusion": factory_of(make_backend(detect=match))}
    reg = registry(ep_with_detector("zed", match), builtins=builtins)
    with pytest.raises(RuntimeError) as info:
        reg.auto_detect(REQ)
    assert str(info.value) == (
        "Multiple serve backends matched this request: diffusion, zed. "
        "Select one explicitly with --model-type BACKEND."
    )


def test_auto_detect_skips_broken_plugins_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    def crash(request: ServeRequest) -> ServeBackendDetection:
        raise RuntimeError("detector exploded")

    reg = registry(
        FakeEntryPoint("broken", dist_name="broken-dist", error=ImportError("cannot import x")),
        ep_with_detector("crashy", crash),
        ep_with_detector("liar", lambda r: "MATCH"),  # a string is not a ServeBackendDetection
        ep_with_detector("dup", lambda r: ServeBackendDetection.MATCH),
        FakeEntryPoint("dup", dist_name="other-dist"),
        FakeEntryPoint("badversion", target=factory_of(make_backend(api_version=0))),
    )
    with caplog.at_level(logging.WARNING, logger="servelm.cli.serve_backends"):
        assert reg.auto_detect(REQ) == "llm"
    text = caplog.text
    for expected in ("'broken'", "cannot import x", "'crashy'", "detector exploded", "'liar'", "str",
                     "Multiple distributions register serve backend 'dup'", "'badversion'"):
        assert expected in text


def test_auto_detect_broken_plugin_does_not_hide_a_match(caplog: pytest.LogCaptureFixture) -> None:
    reg = registry(FakeEntryPoint("broken", error=ImportError("x")),
                   ep_with_detector("good", lambda r: ServeBackendDetection.MATCH))
    with caplog.at_level(logging.WARNING):
        assert reg.auto_detect(REQ) == "good"


# ------------------------------------------------------------ module-level API
def test_module_functions_use_default_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = registry(ep_with_detector("mine", lambda r: ServeBackendDetection.MATCH))
    monkeypatch.setattr(sb, "_default_registry", reg)
    assert sb.default_registry() is reg
    assert sb.available_names() == ["llm", "diffusion", "mine"]
    assert sb.get("mine").api_version == 1
    assert sb.auto_detect(REQ) == "mine"


def test_default_registry_reads_installed_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata as md

    ep = md.EntryPoint(name="viaspec", value="json:dumps", group=sb.ENTRY_POINT_GROUP)
    groups: list[str] = []

    def fake_entry_points(*, group: str) -> list[md.EntryPoint]:
        groups.append(group)
        return [ep]

    monkeypatch.setattr(md, "entry_points", fake_entry_points)
    monkeypatch.setattr(sb, "_default_registry", None)
    assert sb.available_names() == ["llm", "diffusion", "viaspec"]
    assert groups == ["servelm.serve_backends"]
    # json.dumps is callable but raises TypeError when called with no arguments: a failing factory.
    with pytest.raises(RuntimeError, match=r"^Failed to load serve backend 'viaspec' from unknown distribution"):
        sb.get("viaspec")
