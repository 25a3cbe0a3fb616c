"""The diffusion server's options: flags, a --config file, their checks (torch-free)."""

from __future__ import annotations

from pathlib import Path

import pytest

from servelm.config import ConfigError
from servelm.diffusion.config import DiffusionServerArgs, build_parser


def parse(*argv: str) -> DiffusionServerArgs:
    return DiffusionServerArgs.from_namespace(build_parser().parse_args(list(argv)))


def test_flags_then_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: /models/sd\nmax-batch-size: 2\nport: 31001\n")
    args = parse("--config", str(cfg), "--port", "31002")
    assert (args.model_path, args.max_batch_size, args.port) == ("/models/sd", 2, 31002)
    assert args.model_name == "/models/sd" and parse("--model", "m", "--served-model-name", "x").model_name == "x"


@pytest.mark.parametrize(("argv", "config", "message"), [
    ((), None, "--model-path is required"),
    (("--model-path", "m", "--max-batch-size", "0"), None, "--max-batch-size must be >= 1, got 0"),
    (("--model-path", "m", "--max-queued-requests", "0"), None, "--max-queued-requests must be >= 1, got 0"),
    (("--model-path", "m", "--num-threads", "0"), None, "--num-threads must be >= 1, got 0"),
    (("--model-path", "m"), "tp-size: 2\n", "unknown key 'tp-size'"),
])
def test_bad_options(tmp_path: Path, argv: tuple[str, ...], config: str | None, message: str) -> None:
    if config is not None:
        (tmp_path / "c.yaml").write_text(config)
        argv = (*argv, "--config", str(tmp_path / "c.yaml"))
    with pytest.raises(ConfigError, match=message):
        parse(*argv)
