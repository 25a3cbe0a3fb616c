"""The built-in `llm` and `diffusion` serve backends."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from servelm.backends import diffusion, llm
from servelm.cli.serve import CliError
from servelm.cli.serve_backends import ServeBackendDetection, ServeRequest
from servelm.config import ConfigError, ServerArgs

MATCH, NO_MATCH, UNKNOWN = ServeBackendDetection.MATCH, ServeBackendDetection.NO_MATCH, ServeBackendDetection.UNKNOWN


def req(path: str | Path | None) -> ServeRequest:
    p = None if path is None else str(path)
    return ServeRequest(argv=() if p is None else ("--model-path", p), model_path=p)


# ------------------------------------------------------------ diffusion detector
def card(front_matter: str, body: str = "# Model\n") -> str:
    return f"---\n{front_matter}\n---\n{body}"


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"model_index.json": json.dumps({"_class_name": "StableDiffusionPipeline",
                                          "_diffusers_version": "0.30.0"})}, MATCH),
        ({"model_index.json": json.dumps({"_class_name": "X"})}, NO_MATCH),
        ({"model_index.json": "{not json"}, NO_MATCH),
        ({"model_index.json": "[1, 2]"}, NO_MATCH),
        ({"README.md": card("library_name: diffusers\nlicense: mit")}, MATCH),
        ({"README.md": card("pipeline_tag: text-to-image")}, MATCH),
        ({"README.md": card("pipeline_tag: image-to-video")}, MATCH),
        ({"README.md": card("pipeline_tag: text-to-audio")}, MATCH),
        ({"README.md": card("pipeline_tag: image-to-3d")}, MATCH),
        ({"README.md": card("library_name: transformers\npipeline_tag: text-generation")}, NO_MATCH),
        ({"README.md": card("pipeline_tag: image-to-text")}, NO_MATCH),
        # Only the YAML front matter counts, not prose that mentions diffusers.
        ({"README.md": "# Model\nlibrary_name: diffusers\npipeline_tag: text-to-image\n"}, NO_MATCH),
        ({"README.md": "---\nlibrary_name: diffusers\n"}, NO_MATCH),  # front matter never closed
        ({"README.md": card("library_name: [unclosed")}, NO_MATCH),
        ({"config.json": json.dumps({"architectures": ["LlamaForCausalLM"]}),
          "README.md": card("library_name: transformers")}, NO_MATCH),
        ({}, NO_MATCH),
    ],
)
def test_diffusion_detector_on_folders(tmp_path: Path, files: dict[str, str], expected: ServeBackendDetection) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert diffusion.detect(req(tmp_path)) is expected


def test_diffusion_detector_without_path_is_unknown() -> None:
    assert diffusion.detect(req(None)) is UNKNOWN


def test_diffusion_detector_non_folder_paths(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert diffusion.detect(req(gguf)) is NO_MATCH
    assert diffusion.detect(req(tmp_path / "missing")) is NO_MATCH
    assert diffusion.detect(req("org/some-model")) is NO_MATCH


def test_detecting_imports_no_diffusion_runtime(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_diffusers_version": "0.1"}))
    code = (
        "import sys\n"
        "from servelm.cli.serve_backends import ServeBackendRegistry, ServeRequest\n"
        "r = ServeBackendRegistry(entry_points=[])\n"
        f"print(r.auto_detect(ServeRequest(argv=(), model_path={str(tmp_path)!r})))\n"
        "print(r.auto_detect(ServeRequest(argv=(), model_path='/nonexistent')))\n"
        "print([m for m in ('diffusers', 'torch', 'transformers') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:3] == ["diffusion", "llm", "[]"]


def test_diffusion_backend_contract() -> None:
    backend = diffusion.create_backend()
    assert backend.api_version == 1 and backend.requires_model_path is True
    assert backend.detect is diffusion.detect


def test_diffusion_help_lists_its_options_and_imports_no_runtime() -> None:
    code = (
        "import sys\n"
        "from servelm.backends import diffusion\n"
        "from servelm.cli.serve_backends import ServeRequest\n"
        "diffusion.run(ServeRequest(argv=('--help',)))\n"
        "print([m for m in ('diffusers', 'torch', 'servelm.diffusion.runtime', 'servelm.diffusion.server') "
        "if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("usage: servelm serve --model-type diffusion")
    for option in ("--model-path", "--max-batch-size", "--max-queued-requests", "--api-key", "/v1/images/edits"):
        assert option in out
    assert out.rstrip().endswith("[]")


@pytest.mark.parametrize(("files", "message"), [
    ({}, "is not a diffusers pipeline folder: no model_index.json"),
    ({"model_index.json": json.dumps({"_diffusers_version": "0.30.0"})}, "naming its pipeline class"),
])
def test_diffusion_run_refuses_a_folder_that_is_not_a_pipeline(tmp_path: Path, files: dict[str, str],
                                                               message: str) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(CliError, match=message):
        diffusion.run(req(tmp_path))
    with pytest.raises(CliError, match="is not a local folder"):
        diffusion.run(req(tmp_path / "missing"))


def test_diffusion_without_diffusers_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    real = diffusion.importlib.util.find_spec
    monkeypatch.setattr(diffusion.importlib.util, "find_spec", lambda name: None if name == "diffusers" else real(name))
    with pytest.raises(CliError) as info:
        diffusion.run(req(tmp_path))
    assert str(info.value) == ("The diffusion backend needs diffusers, Pillow and python-multipart "
                               "(missing: diffusers): pip install 'servelm[diffusion]'")


# ------------------------------------------------------------ llm
@pytest.fixture
def fake_http_server(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Stand-in for servelm.entrypoints.launch; records what launch_server got."""
    launched: list[Any] = []
    module = types.ModuleType("servelm.entrypoints.launch")
    module.launch_server = launched.append  # type: ignore[attr-defined]
    module.ServerError = RuntimeError  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "servelm.entrypoints.launch", module)
    return launched


def test_llm_backend_contract() -> None:
    backend = llm.create_backend()
    assert backend.api_version == 1
    assert backend.requires_model_path is False
    assert backend.detect is None


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_llm_help_prints_serverargs_help_and_launches_nothing(
    flag: str, fake_http_server: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    llm.run(ServeRequest(argv=("--model-path", "m", flag)))
    out = capsys.readouterr().out
    assert out.startswith("usage: servelm serve")
    for option in ("--model-path", "--tp-size", "--chunked-prefill-size", "--config"):
        assert option in out
    assert fake_http_server == []


def gguf_file(folder: Path) -> str:
    """A file that passes the CLI's look at a model path (the fake server loads nothing)."""
    path = folder / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(16))
    return str(path)


def test_llm_run_launches_with_parsed_server_args(fake_http_server: list[Any], tmp_path: Path) -> None:
    model = gguf_file(tmp_path)
    llm.run(ServeRequest(argv=("--model-path", model, "--tp", "2", "--port", "31000"), model_path=model))
    assert len(fake_http_server) == 1
    args = fake_http_server[0]
    assert isinstance(args, ServerArgs)
    assert (args.model_path, args.tp_size, args.port) == (model, 2, 31000)


def test_llm_run_refuses_a_bad_model_path_before_launching(fake_http_server: list[Any], tmp_path: Path) -> None:
    with pytest.raises(CliError, match="does not exist"):
        llm.run(ServeRequest(argv=("--model-path", str(tmp_path / "nope")), model_path=str(tmp_path / "nope")))
    assert fake_http_server == []


def test_llm_run_without_model_serves_the_default_model(fake_http_server: list[Any]) -> None:
    llm.run(ServeRequest(argv=()))
    assert fake_http_server[0].model_path is None


def test_llm_run_reads_config_file(fake_http_server: list[Any], tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    model = gguf_file(tmp_path)
    cfg.write_text(f"model: {model}\nport: 31001\n")
    llm.run(ServeRequest(argv=("--config", str(cfg), "--port", "31002")))
    assert (fake_http_server[0].model_path, fake_http_server[0].port) == (model, 31002)


def test_llm_run_invalid_values_raise_config_error(fake_http_server: list[Any]) -> None:
    with pytest.raises(ConfigError, match="--port must be in"):
        llm.run(ServeRequest(argv=("--port", "0")))
    with pytest.raises(CliError, match="unrecognized arguments: --bogus"):
        llm.run(ServeRequest(argv=("--bogus",)))
    assert fake_http_server == []
