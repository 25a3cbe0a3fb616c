"""The command line beats `--config` YAML for every flag it gives, its default value included, in both
servers' options (one helper, servelm.dataclass_flags); the file fills only the flags left out."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from servelm.config import ServerArgs
from servelm.dataclass_flags import ConfigError
from servelm.diffusion.config import DiffusionServerArgs, build_parser


def _llm(*argv: str) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_namespace(parser.parse_args(list(argv)))


def _diffusion(*argv: str) -> DiffusionServerArgs:
    return DiffusionServerArgs.from_namespace(build_parser().parse_args(list(argv)))


@pytest.mark.parametrize("parse", [_llm, _diffusion])
def test_a_flag_at_its_default_value_beats_the_file(parse, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: /from/yaml\nport: 31000\nhost: 0.0.0.0\nlog-level: debug\n")
    args = parse("--config", str(cfg), "--port", "30000", "--log-level", "info")  # both the defaults
    assert (args.port, args.log_level) == (30000, "info")
    assert (args.model_path, args.host) == ("/from/yaml", "0.0.0.0")  # the flags not given come from the file
    assert parse("--config", str(cfg)).port == 31000


def test_bool_flags_and_their_negations_beat_the_file(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("disable-radix-cache: true\nlog-requests: true\n")
    assert _llm("--config", str(cfg)).disable_radix_cache is True
    args = _llm("--config", str(cfg), "--enable-prefix-caching", "--disable-log-requests")
    assert args.disable_radix_cache is False and args.log_requests is False
    assert _llm("--config", str(cfg), "--no-enable-prefix-caching").disable_radix_cache is True  # an alias


def test_a_namespace_from_elsewhere_keeps_the_default_rule(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("port: 31000\n")
    ns = argparse.Namespace(config=str(cfg), port=30000, model_path=None)
    assert ServerArgs.from_namespace(ns).port == 31000  # no record of given flags: a default is not "given"
    with pytest.raises(ConfigError, match="unknown key 'nope'"):
        cfg.write_text("nope: 1\n")
        _llm("--config", str(cfg))
