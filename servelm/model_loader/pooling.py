"""An embedding model's pooling, read from its sentence-transformers files, and whether a model folder is
served as an embedding model at all. Torch-free (the API process and the scheduler both read it)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from servelm.dataclass_flags import ConfigError
from servelm.model_loader.model_path import ENCODER_ARCHITECTURES, read_hf_config

POOLING_MODES = ("mean", "cls", "last", "max", "mean_sqrt_len", "weightedmean")
# sentence-transformers' Pooling config keys, in the order its Pooling module concatenates the enabled modes.
_ST_MODES = (("pooling_mode_cls_token", "cls"), ("pooling_mode_max_tokens", "max"),
             ("pooling_mode_mean_tokens", "mean"), ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len"),
             ("pooling_mode_weightedmean_tokens", "weightedmean"), ("pooling_mode_lasttoken", "last"))


@dataclass(frozen=True)
class PoolingConfig:
    """How token states become one embedding: `mode` (one of POOLING_MODES, or several joined by "+", whose
    vectors are concatenated in that order, as sentence-transformers does), unit length or not, and
    sentence-transformers' own input limit (`max_seq_length`, which it truncates to; None without
    sentence_bert_config.json)."""

    mode: str
    normalize: bool
    max_seq_length: int | None = None
    source: str = "default"  # where it came from (logged)


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_pooling(folder: str, default_mode: str = "cls") -> PoolingConfig:
    """The pooling a sentence-transformers folder declares: modules.json names its Pooling module (whose
    config.json enables CLS, max, mean, mean-sqrt-len, weighted-mean or last-token pooling, or several, then
    concatenated) and whether a Normalize module follows. Without modules.json: `default_mode`, normalised (as
    vLLM's embedding pooler does by default)."""
    modules = _read_json(os.path.join(folder, "modules.json"))
    st_config = _read_json(os.path.join(folder, "sentence_bert_config.json")) or {}
    max_len = st_config.get("max_seq_length") if isinstance(st_config, dict) else None
    max_len = int(max_len) if isinstance(max_len, int) and max_len > 0 else None
    if not isinstance(modules, list):
        return PoolingConfig(default_mode, True, max_len)
    types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
    normalize = any(t.endswith(".Normalize") for t in types)
    mode = default_mode
    for m in modules:
        if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling"):
            cfg = _read_json(os.path.join(folder, str(m.get("path", "")), "config.json")) or {}
            modes = [name for key, name in _ST_MODES if cfg.get(key)]
            unknown = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v
                       and k not in dict(_ST_MODES)]
            if unknown or not modes:
                raise ConfigError(f"{folder}: pooling {', '.join(unknown) or 'none'} is not supported (cls, max, "
                                  "mean, mean_sqrt_len, weightedmean or last token); pass --pooling to choose one")
            mode = "+".join(modes)
    return PoolingConfig(mode, normalize, max_len, "modules.json")


def is_embedding_model(folder: str, architecture: str | None) -> bool:
    """An encoder architecture, or a sentence-transformers folder (modules.json with a Pooling module)."""
    if architecture in ENCODER_ARCHITECTURES:
        return True
    modules = _read_json(os.path.join(folder, "modules.json")) if os.path.isdir(folder) else None
    return isinstance(modules, list) and any(
        isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling") for m in modules)


def embedding_mode(server_args: Any, model_path: str) -> bool:
    """Whether `model_path` is served as an embedding model: asked for (--is-embedding, --runner pooling),
    refused (--runner generate), or detected (an encoder architecture or a sentence-transformers folder)."""
    if server_args.is_embedding or server_args.runner == "pooling":
        return True
    if server_args.runner == "generate":
        return False
    if os.path.isfile(model_path):  # a GGUF file: llama.cpp's BERT encoders embed
        from servelm.model_loader.gguf_bert import architecture

        return architecture(model_path) == "bert"
    if not os.path.isdir(model_path):
        return False
    try:
        _, architecture = read_hf_config(model_path)
    except Exception:  # an architecture servelm does not know: modules.json alone decides
        architecture = None
    return is_embedding_model(model_path, architecture)
