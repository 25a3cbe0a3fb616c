"""The types every model source shares (a GGUF file, a Hugging Face folder): `ModelSource` and the errors of
reading one. `servelm.model_loader.source.load_model_source` picks the source; the sources import only this."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import transformers

from servelm.model_loader.model_path import ModelSourceError


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
