"""Model paths, checked without torch: what a path holds (GGUF file or HF folder) and whether servelm can
load it. The CLI calls `check_model_path` before any process starts or torch loads, so that a wrong path,
a Hub id, a folder without config.json or a file that is no GGUF fails in a moment, in one line.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

# Architectures (HF `config.architectures[0]`) the servelm model registry implements.
# Encoders, served as embedding models (servelm.model_executor.embedding_runner).
ENCODER_ARCHITECTURES: tuple[str, ...] = ("BertModel", "BertForSequenceClassification")
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *ENCODER_ARCHITECTURES,
)
# For config.json files without an "architectures" entry.
MODEL_TYPE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
GGUF_MAGIC = b"GGUF"
_WHAT_TO_PASS = "Pass a .gguf file or a Hugging Face model folder (with config.json and *.safetensors)"


class ModelSourceError(ValueError):
    """A model path cannot be loaded; the message says what is wrong and what to do."""


class ModelPathNotFoundError(ModelSourceError, FileNotFoundError):
    """The model path does not exist or holds nothing servelm can load."""


class UnsupportedArchitectureError(ModelSourceError):
    """The model's architecture has no servelm implementation."""

    def __init__(self, architecture: str, origin: str = "") -> None:
        self.architecture = architecture
        where = f" ({origin})" if origin else ""
        super().__init__(
            f"Unsupported model architecture {architecture!r}{where}. "
            f"Supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}."
        )


def check_architecture(architecture: str | None, origin: str) -> str:
    """Return `architecture` if servelm implements it, else raise UnsupportedArchitectureError."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(str(architecture), origin)
    return architecture


def resolve_model_path(path: str) -> tuple[str, Literal["gguf", "hf"]]:
    """Classify `path` as a GGUF file or a HF folder; return (normalised path, format).

    A folder without config.json that holds exactly one .gguf file resolves to that file.
    """
    given = os.fspath(path)
    path = os.path.abspath(os.path.expanduser(given))
    if not os.path.exists(path):
        hub = given.count("/") == 1 and not given.startswith((".", "/", "~"))
        raise ModelPathNotFoundError(
            f"Model path {path} does not exist"
            + (f" ({given!r} looks like a Hugging Face Hub id)" if hub else "")
            + f". {_WHAT_TO_PASS}; downloads from the Hub are not supported."
        )
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return path, "gguf"
        raise ModelPathNotFoundError(f"Model path {path} is a file but not a .gguf file. {_WHAT_TO_PASS}.")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path, "hf"
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return os.path.join(path, ggufs[0]), "gguf"
    if ggufs:
        raise ModelPathNotFoundError(
            f"Model folder {path} holds several .gguf files ({', '.join(ggufs)}); pass one of them."
        )
    raise ModelPathNotFoundError(f"Model folder {path} has no config.json and no .gguf file. {_WHAT_TO_PASS}.")


def read_hf_config(folder: str) -> tuple[dict[str, Any], str]:
    """config.json of a HF folder as a dict, and its architecture (checked against the registry)."""
    config_path = os.path.join(folder, "config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelSourceError(f"Cannot read {config_path}: {e}") from e
    if not isinstance(raw, dict):
        raise ModelSourceError(f"Cannot read {config_path}: it holds no JSON object")
    architecture = (raw.get("architectures") or [None])[0] or MODEL_TYPE_ARCHITECTURES.get(raw.get("model_type"))
    origin = f"config.json of {folder}"
    return raw, check_architecture(architecture, origin if architecture else f"{origin} has no 'architectures'")


def check_model_path(path: str) -> tuple[str, Literal["gguf", "hf"]]:
    """`resolve_model_path`, then a cheap look inside: a GGUF file starts with the GGUF magic bytes; a HF
    folder has a readable config.json of a supported architecture and safetensors weights.

    Reads a few bytes and one small JSON file: no torch, no weights. Raises ModelSourceError.
    """
    resolved, fmt = resolve_model_path(path)
    if fmt == "gguf":
        try:
            with open(resolved, "rb") as f:
                magic = f.read(len(GGUF_MAGIC))
        except OSError as e:
            raise ModelSourceError(f"Cannot read {resolved}: {e}") from e
        if magic != GGUF_MAGIC:
            raise ModelSourceError(f"{resolved} is not a GGUF file (it does not start with the bytes 'GGUF'). "
                                   f"{_WHAT_TO_PASS}.")
        return resolved, fmt
    read_hf_config(resolved)
    if not any(os.path.isfile(os.path.join(resolved, name)) for name in (SAFETENSORS_FILE, SAFETENSORS_INDEX_FILE)):
        raise ModelSourceError(
            f"Model folder {resolved} has no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX_FILE}; only safetensors "
            "weights are supported (convert *.bin checkpoints with transformers' "
            "save_pretrained(safe_serialization=True))."
        )
    return resolved, fmt
