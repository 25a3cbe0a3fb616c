"""Where a model's config and weights come from: a GGUF file or a Hugging Face folder.

`load_model_source(path)` reads only metadata (config, tensor index); the weights are produced lazily,
one tensor at a time, by `ModelSource.iter_weights(dtype)` so that a model runner can copy (and shard)
each one into its parameters without holding two copies of the model in memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import transformers

# Re-exported: the torch-free path checks live in model_path.py.
from servelm.model_loader.model_path import (  # noqa: F401
    SUPPORTED_ARCHITECTURES,
    ModelPathNotFoundError,
    ModelSourceError,
    UnsupportedArchitectureError,
    check_architecture,
    resolve_model_path,
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
    def iter_weights(self, dtype: torch.dtype, keep_formats: frozenset[str] = frozenset(),
                     embedding_formats: frozenset[str] = frozenset()) -> Iterator[tuple[str, Any]]:
        """Yield `(hf_name, tensor)` pairs: contiguous CPU tensors of `dtype`, in file order.

        A source that stores quantised blocks yields a 2-D weight whose format is in `keep_formats`
        as a `servelm.kernels.quant.QuantWeight` instead (GGUF; a HF folder has none), and the embedding
        `model.embed_tokens.weight` too when its format is in `embedding_formats`.
        """

    @property
    def architecture(self) -> str:
        """The HF architecture name, e.g. "LlamaForCausalLM"."""
        return self.config.architectures[0]


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
