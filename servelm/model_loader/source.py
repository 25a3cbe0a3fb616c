"""Where a model's config and weights come from: a GGUF file or a Hugging Face folder.

`load_model_source(path)` reads only metadata (config, tensor index); the weights are produced lazily,
one tensor at a time, by `ModelSource.iter_weights(dtype)` so that a model runner can copy (and shard)
each one into its parameters without holding two copies of the model in memory.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import transformers

# Architectures (HF `config.architectures[0]`) the servelm model registry implements.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


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


class UnsupportedQuantizationError(ModelSourceError):
    """A GGUF tensor uses a quantisation type we cannot dequantise."""

    def __init__(self, quant_type: str, tensor_name: str, path: str) -> None:
        self.quant_type = quant_type
        super().__init__(
            f"Unsupported GGUF quantisation type {quant_type} (tensor {tensor_name!r} in {path}). "
            "Use a GGUF file quantised with a type the `gguf` package can dequantise "
            "(F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ*), or a HF safetensors folder."
        )


@dataclass
class ModelSource(ABC):
    """A model's config plus a lazy stream of its weights under HF parameter names.

    Attributes:
        path: the .gguf file or the HF model folder.
        format: "gguf" or "hf".
        config: a transformers config (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config) whose
            `architectures[0]` is one of SUPPORTED_ARCHITECTURES. RoPE settings live in
            `config.rope_parameters` (transformers 5: `rope_theta`, `rope_type`, scaling keys).
        num_weights: how many tensors `iter_weights` yields (for a progress bar).

    NOTE: tied embeddings (`config.tie_word_embeddings`) yield no `lm_head.weight`, as in a HF
    safetensors checkpoint; the model ties lm_head to `model.embed_tokens.weight` itself.
    """

    path: str
    format: Literal["gguf", "hf"]
    config: transformers.PretrainedConfig
    num_weights: int

    @abstractmethod
    def iter_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(hf_name, tensor)` pairs: contiguous CPU tensors of `dtype`, in file order."""

    @property
    def architecture(self) -> str:
        """The HF architecture name, e.g. "LlamaForCausalLM"."""
        return self.config.architectures[0]


def check_architecture(architecture: str | None, origin: str) -> str:
    """Return `architecture` if servelm implements it, else raise UnsupportedArchitectureError."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(str(architecture), origin)
    return architecture


def resolve_model_path(path: str) -> tuple[str, Literal["gguf", "hf"]]:
    """Classify `path` as a GGUF file or a HF folder; return (normalised path, format).

    A folder without config.json that holds exactly one .gguf file resolves to that file.
    """
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.exists(path):
        raise ModelPathNotFoundError(
            f"Model path {path} does not exist. Pass a .gguf file or a Hugging Face model folder "
            "(with config.json and *.safetensors); downloads from the Hub are not supported."
        )
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return path, "gguf"
        raise ModelPathNotFoundError(
            f"Model path {path} is a file but not a .gguf file. Pass a .gguf file or a Hugging Face "
            "model folder (with config.json and *.safetensors)."
        )
    if os.path.isfile(os.path.join(path, "config.json")):
        return path, "hf"
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return os.path.join(path, ggufs[0]), "gguf"
    if ggufs:
        raise ModelPathNotFoundError(
            f"Model folder {path} holds several .gguf files ({', '.join(ggufs)}); pass one of them."
        )
    raise ModelPathNotFoundError(
        f"Model folder {path} has no config.json and no .gguf file. Pass a .gguf file or a Hugging "
        "Face model folder (with config.json and *.safetensors)."
    )


def load_model_source(path: str) -> ModelSource:
    """Open a model for loading: a `*.gguf` file, or a HF folder with config.json + safetensors.

    Only metadata is read here; tensors are read by `iter_weights`.

    Raises:
        ModelPathNotFoundError: the path is missing or holds no loadable model.
        UnsupportedArchitectureError: the architecture is not one of SUPPORTED_ARCHITECTURES.
        UnsupportedQuantizationError: a GGUF tensor uses a type we cannot dequantise.
        ModelSourceError: any other malformed model (e.g. no safetensors weights).
    """
    resolved, fmt = resolve_model_path(path)
    # Imported lazily so that importing servelm.model_loader stays cheap.
    if fmt == "gguf":
        from servelm.model_loader.gguf import load_gguf_source

        return load_gguf_source(resolved)
    from servelm.model_loader.safetensors import load_hf_source

    return load_hf_source(resolved)
