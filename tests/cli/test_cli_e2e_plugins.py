"""End to end: real plugin distributions, installed with pip, driving `python -m servelm` in subprocesses.

One pip install (session fixture) puts three throw-away distributions in a
target folder that goes on PYTHONPATH:

* servelm-e2e-plugin: `myplugin`; importing its module drops a marker file,
  its detector matches paths ending in `.myplugin`, and its run records the
  request and spawns `sleep 300` (then returns, raises or blocks).
* servelm-e2e-other: `otherplugin`, also leaving an import marker.
* servelm-e2e-broken: `brokenplugin`, whose module imports a missing package.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

PLUGIN_MODULE = textwrap.dedent('''\
    import json, os, subprocess, sys, time
    from pathlib import Path

    from servelm.cli.serve_backends import ServeBackend, ServeBackendDetection

    MARKERS = Path(os.environ["SERVELM_E2E_MARKERS"])
    NAME = "{name}"
    (MARKERS / f"{{NAME}}-imported").write_text("1")


    def detect(request):
        path = request.model_path or ""
        return ServeBackendDetection.MATCH if path.endswith("." + NAME) else ServeBackendDetection.NO_MATCH


    def run(request):
        if "--help" in request.argv or "-h" in request.argv:
            print(f"{{NAME}} help: usage: servelm serve --model-type {{NAME}} MODEL")
            return
        (MARKERS / f"{{NAME}}-request.json").write_text(json.dumps({{
            "argv": list(request.argv), "model_path": request.model_path,
            "positional": request.model_path_is_positional}}))
        mode = os.environ.get("SERVELM_E2E_MODE", "return")
        if mode == "return":
            return
        # DEVNULL: a leaked child must not hold the test's output pipes open.
        child = subprocess.Popen(["sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        (MARKERS / f"{{NAME}}-child.pid").write_text(str(child.pid))
        if mode == "spawn-raise":
            raise RuntimeError("backend crashed after spawning")
        if mode == "spawn-block":
            print("ready", flush=True)
            time.sleep(300)


    def create_backend():
        return ServeBackend(api_version=1, run=run, detect=detect)
''')

PYPROJECT = textwrap.dedent('''\
    [build-system]
    requires = ["setuptools>=64"]
    build-backend = "setuptools.build_meta"

    [project]
    name = "{dist}"
    version = "0.0.1"

    [project.entry-points."servelm.serve_backends"]
    {name} = "{package}.backend:create_backend"

    [tool.setuptools]
    packages = ["{package}"]
''')


def _write_distribution(root: Path, dist: str, name: str, module_text: str) -> Path:
    package = dist.replace("-", "_")
    src = root / dist
    (src / package).mkdir(parents=True)
    (src / "pyproject.toml").write_text(PYPROJECT.format(dist=dist, name=name, package=package))
    (src / package / "__init__.py").write_text("")
    (src / package / "backend.py").write_text(module_text)
    return src


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the three installed plugin distributions (one pip run for the session)."""
    root = tmp_path_factory.mktemp("servelm-plugins")
    sources = [
        _write_distribution(root, "servelm-e2e-plugin", "myplugin", PLUGIN_MODULE.format(name="myplugin")),
        _write_distribution(root, "servelm-e2e-other", "otherplugin", PLUGIN_MODULE.format(name="otherplugin")),
        _write_distribution(root, "servelm-e2e-broken", "brokenplugin",
                            "import servelm_e2e_missing_dependency  # noqa: F401\n"),
    ]
    site = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--target", str(site), *map(str, sources)],
        check=True, capture_output=True, text=True,
    )
    return site


@pytest.fixture
def markers(tmp_path: Path) -> Path:
    path = tmp_path / "markers"
    path.mkdir()
    return path


def _env(site: Path, markers: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SERVELM_DEBUG", "SERVELM_E2E_MODE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    env["SERVELM_E2E_MARKERS"] = str(markers)
    env.update(extra)
    return env


def servelm(site: Path, markers: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "servelm", *args], env=_env(site, markers, **extra),
                          capture_output=True, text=True, timeout=60)


def _imported(markers: Path) -> set[str]:
    return {p.name.removesuffix("-imported") for p in markers.glob("*-imported")}


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pid: int, seconds: float = 5.0) -> bool:
    # Once the CLI exits, init reaps the killed child; give it a moment.
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return False


def _kill_if_leaked(pid: int) -> None:
    # Only when the feature is broken: do not leave a `sleep 300` behind the test run.
    try:
        proc = psutil.Process(pid)
        if proc.name() == "sleep":
            proc.kill()
    except psutil.Error:
        pass


def test_model_type_runs_the_plugin(plugin_site: Path, markers: Path) -> None:
    proc = servelm(plugin_site, markers, "serve", "--model-type", "myplugin", "org/model", "--tp", "2")
    assert proc.returncode == 0, proc.stderr
    request = json.loads((markers / "myplugin-request.json").read_text())
    assert request == {"argv": ["--model-path", "org/model", "--tp", "2"], "model_path": "org/model",
                       "positional": True}
    assert _imported(markers) == {"myplugin"}


def test_auto_detection_picks_plugin_despite_broken_one(plugin_site: Path, markers: Path) -> None:
    proc = servelm(plugin_site, markers, "serve", "--model-path=weights.myplugin")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((markers / "myplugin-request.json").read_text())["model_path"] == "weights.myplugin"
    assert not (markers / "otherplugin-request.json").exists()
    assert "Skipping serve backend 'brokenplugin'" in proc.stderr


@pytest.mark.parametrize(("mode", "code"), [("spawn", 0), ("spawn-raise", 1)])
def test_children_of_the_backend_are_gone_after_exit(plugin_site: Path, markers: Path, mode: str, code: int) -> None:
    proc = servelm(plugin_site, markers, "serve", "--model-type", "myplugin", "m", SERVELM_E2E_MODE=mode)
    assert proc.returncode == code, proc.stderr
    pid = int((markers / "myplugin-child.pid").read_text())
    try:
        assert _wait_gone(pid)
    finally:
        _kill_if_leaked(pid)
    if mode == "spawn-raise":
        assert proc.stderr.strip().endswith("Error: RuntimeError: backend crashed after spawning")
        assert "Traceback" not in proc.stderr


def test_sigterm_to_servelm_stops_backend_children(plugin_site: Path, markers: Path) -> None:
    cli = subprocess.Popen([sys.executable, "-m", "servelm", "serve", "--model-type", "myplugin", "m"],
                           env=_env(plugin_site, markers, SERVELM_E2E_MODE="spawn-block"),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert cli.stdout.readline().strip() == "ready"
        pid = int((markers / "myplugin-child.pid").read_text())
        assert not _gone(pid)
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=15) == 128 + signal.SIGTERM
        assert _wait_gone(pid)
    finally:
        cli.kill()
        cli.communicate()
        if (markers / "myplugin-child.pid").exists():
            _kill_if_leaked(int((markers / "myplugin-child.pid").read_text()))


def test_backends_lists_plugins_with_distributions(plugin_site: Path, markers: Path) -> None:
    proc = servelm(plugin_site, markers, "backends")
    assert proc.returncode == 0
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()[1:]}
    assert list(rows) == ["llm", "diffusion", "brokenplugin", "myplugin", "otherplugin"]
    assert rows["myplugin"].split() == ["myplugin", "servelm-e2e-plugin", "1", "yes", "ok"]
    assert rows["otherplugin"].split()[:2] == ["otherplugin", "servelm-e2e-other"]
    assert ("error: Failed to load serve backend 'brokenplugin' from servelm-e2e-broken: "
            "No module named 'servelm_e2e_missing_dependency'") in rows["brokenplugin"]
    assert "1 serve backend(s) failed to load: brokenplugin" in proc.stderr


def test_general_help_imports_no_plugin(plugin_site: Path, markers: Path) -> None:
    proc = servelm(plugin_site, markers, "serve", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "available: auto, llm, diffusion, brokenplugin, myplugin, otherplugin" in proc.stdout
    assert "=== backend: llm ===" in proc.stdout and "=== backend: diffusion ===" in proc.stdout
    assert "myplugin help" not in proc.stdout
    assert _imported(markers) == set()


def test_explicit_other_backend_does_not_import_plugin(plugin_site: Path, markers: Path) -> None:
    proc = servelm(plugin_site, markers, "serve", "--model-type", "otherplugin", "m")
    assert proc.returncode == 0, proc.stderr
    assert _imported(markers) == {"otherplugin"}
    proc = servelm(plugin_site, markers, "serve", "--model-type", "llm", "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: servelm serve")
    assert _imported(markers) == {"otherplugin"}


def test_targeted_help_imports_only_that_plugin(plugin_site: Path, markers: Path) -> None:
    proc = servelm(plugin_site, markers, "serve", "--model-type", "myplugin", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "myplugin help: usage: servelm serve --model-type myplugin MODEL\n"
    assert _imported(markers) == {"myplugin"}
    assert not (markers / "myplugin-request.json").exists()


def test_broken_plugin_message_names_plugin_distribution_and_cause(plugin_site: Path, markers: Path) -> None:
    proc = servelm(plugin_site, markers, "serve", "--model-type", "brokenplugin", "m")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "Error: Failed to load serve backend 'brokenplugin' from servelm-e2e-broken: "
        "No module named 'servelm_e2e_missing_dependency'",
        "  caused by: ModuleNotFoundError: No module named 'servelm_e2e_missing_dependency'",
    ]
