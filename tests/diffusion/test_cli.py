"""`servelm generate` for a diffusers folder and the diffusion backend's one-line CLI errors (in-process)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from servelm.cli.main import main
from tests.server_fixtures import free_port


@pytest.fixture(autouse=True)
def _keep_thread_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """generate/serve set this process's CPU threads (torch and the OMP environment): put them back."""
    import torch

    from servelm.cpu_threads import DEFAULTED_ENV

    threads = torch.get_num_threads()
    for name in ("OMP_NUM_THREADS", DEFAULTED_ENV):  # monkeypatch restores them (or their absence)
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)
    yield
    torch.set_num_threads(threads)


def test_generate_writes_pngs_and_prints_their_paths(tiny_sd: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "out"
    argv = ["generate", "--model-path", str(tiny_sd), "--prompt", "a small cat", "--seed", "3", "--steps", "2",
            "--size", "48x32", "--n", "2", "--save-output", "--output-dir", str(out_dir), "--num-threads", "1"]
    assert main(argv) == 0
    paths = capsys.readouterr().out.split()
    assert paths == [str(out_dir / "a-small-cat-seed3-0.png"), str(out_dir / "a-small-cat-seed3-1.png")]
    images = [np.asarray(Image.open(p)) for p in paths]
    assert all(img.shape == (32, 48, 3) for img in images) and not np.array_equal(images[0], images[1])
    # The same seed gives the same file again (a positional model works too).
    assert main(["generate", str(tiny_sd), *argv[3:]]) == 0
    assert np.array_equal(np.asarray(Image.open(capsys.readouterr().out.split()[0])), images[0])


def test_generate_without_save_output_writes_nothing(tiny_sd: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["generate", str(tiny_sd), "--prompt", "x", "--steps", "1", "--num-threads", "1"]) == 0
    assert "Generated 1 image(s) of 32x32" in capsys.readouterr().out and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("extra", "message"), [
    (["--n", "11"], "Error: --n must be in [1, 10], got 11"),
    (["--size", "30x30"], "Error: --size: width and height must be multiples of 8"),
    (["--prompt", " "], "Error: --prompt must not be empty"),
    (["--bogus"], "Error: servelm generate: unrecognized arguments: --bogus"),
])
def test_generate_bad_arguments_are_one_line(tiny_sd: Path, extra: list[str], message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(tiny_sd), "--prompt", "x", "--steps", "1", *extra]) == 1
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


@pytest.fixture
def unloadable(tmp_path: Path) -> Path:
    """A folder that looks like a pipeline but names a class diffusers does not have."""
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "NoSuchPipeline",
                                                           "_diffusers_version": "0.30.0"}))
    return tmp_path


def test_generate_on_a_pipeline_class_diffusers_cannot_load(unloadable: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(unloadable), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"Error: diffusers cannot load the pipeline in {unloadable}: AttributeError")
    assert err.count("\n") == 1


def test_serve_on_a_pipeline_class_diffusers_cannot_load(unloadable: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", str(unloadable), "--port", str(free_port())]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and errors[0].startswith(f"Error: diffusers cannot load the pipeline in {unloadable}")


def test_serve_bad_options_are_one_line(tiny_sd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model-type", "diffusion", str(tiny_sd), "--max-batch-size", "0"]) == 1
    assert capsys.readouterr().err == "Error: --max-batch-size must be >= 1, got 0\n"
