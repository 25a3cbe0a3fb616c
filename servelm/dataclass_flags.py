"""One flag per dataclass field, plus `--config FILE` (YAML): the servers' argument parsing (ServerArgs and
DiffusionServerArgs use it), torch-free.

A field made with `opt` carries its help, choices, aliases (other spellings of the flag: vLLM's, SGLang's) and
negations (flags that set a bool back to False). The parser records which flags the command line gave, so
that a flag given explicitly beats the config file even when its value is the default (comparing with the
default could not tell `--port 30000` from no `--port`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import field
from typing import Any

import yaml

EXPLICIT = "_flags_given"  # the namespace attribute holding the dests the command line set


class ConfigError(ValueError):
    """A server argument is invalid; the message says which and why."""


def opt(default: Any, help: str, *, choices: list | None = None, aliases: tuple[str, ...] = (),
        negations: tuple[str, ...] = ()) -> Any:
    """A field and its flag. `aliases` are other names of the flag (vLLM's and SGLang's spellings);
    `negations` are flags that set a bool field back to False (e.g. vLLM's --enable-prefix-caching for
    --disable-radix-cache)."""
    return field(default=default, metadata={"help": help, "choices": choices, "aliases": aliases,
                                            "negations": negations})


class _Given:
    """An argparse action mixin that records its dest in the namespace's EXPLICIT set when the flag is given."""

    dest: str

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: str | None = None):
        super().__call__(parser, namespace, values, option_string)  # type: ignore[misc]
        given = getattr(namespace, EXPLICIT, None)
        if given is None:
            given = set()
            setattr(namespace, EXPLICIT, given)
        given.add(self.dest)


class _Store(_Given, argparse._StoreAction):
    pass


class _StoreTrue(_Given, argparse._StoreTrueAction):
    pass


class _StoreFalse(_Given, argparse._StoreFalseAction):
    pass


_TYPES = {"int": int, "float": float, "int | None": int, "float | None": float}


def add_flags(parser: argparse.ArgumentParser, cls: type, hidden: frozenset[str] = frozenset()) -> None:
    """`--config` and one flag per field of the dataclass `cls`; defaults, types and help come from the field.
    Fields in `hidden` are still accepted but left out of --help."""
    parser.add_argument("--config", default=None, help="YAML file of arguments (CLI flags win).")
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        names = [flag, *f.metadata.get("aliases", ())]
        default = None if f.default is dataclasses.MISSING else f.default
        help_text = argparse.SUPPRESS if f.name in hidden else f.metadata.get("help", "")
        if f.type in ("bool", bool):
            parser.add_argument(*names, dest=f.name, action=_StoreTrue, default=default, help=help_text)
            negations = f.metadata.get("negations", ())
            if negations:
                parser.add_argument(*negations, dest=f.name, action=_StoreFalse,
                                    help=argparse.SUPPRESS if f.name in hidden else
                                    f"The opposite of {flag} (the default).")
            continue
        ftype = _TYPES.get(str(f.type), str)
        choices = f.metadata.get("choices")
        if choices and ftype is str:
            ftype = str.lower  # --log-level INFO works too
        if f.name not in hidden and default is not None:
            help_text = f"{help_text} (default: {default})"
        parser.add_argument(*names, dest=f.name, action=_Store, type=ftype, default=default, choices=choices,
                            help=help_text)


def values_of(ns: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields' values: the flags, then the `--config` file's keys for the flags the command line did not
    give (`model` is `model_path`). ConfigError for an unknown key or an unreadable file."""
    fields = dataclasses.fields(cls)
    values = {f.name: getattr(ns, f.name) for f in fields if hasattr(ns, f.name)}
    config_path = getattr(ns, "config", None)
    if not config_path:
        return values
    given = getattr(ns, EXPLICIT, None)
    defaults = {f.name: None if f.default is dataclasses.MISSING else f.default for f in fields}
    for key, value in load_config_file(config_path).items():
        name = str(key).replace("-", "_")
        if name == "model":
            name = "model_path"
        if name not in defaults:
            raise ConfigError(f"unknown key '{key}' in config file {config_path}")
        # A flag given on the command line beats the file (a namespace not from add_flags: a non-default one).
        if (name not in given) if given is not None else values.get(name) == defaults[name]:
            values[name] = value
    return values


def load_config_file(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    with open(path) as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of argument names to values")
    return data
