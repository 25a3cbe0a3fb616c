"""Model loading: config + weights (GGUF or HF safetensors) and tokenizers.

Public API (imported lazily so that e.g. `default_model_path` does not pull in torch):

    default_model_path() -> str                      # the embedded SmolLM2 GGUF
    load_model_source(path) -> ModelSource           # .config, .num_weights, .iter_weights(dtype)
    check_model_path(path) -> (path, format)         # torch-free look at a path, before anything loads
    load_tokenizer(path, chat_template=None) -> PreTrainedTokenizerFast
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "DEFAULT_MODEL_DIST": "default_model",
    "DefaultModelMissingError": "default_model",
    "default_model_path": "default_model",
    "SUPPORTED_ARCHITECTURES": "model_path",
    "ModelSource": "source",
    "ModelSourceError": "model_path",
    "ModelPathNotFoundError": "model_path",
    "UnsupportedArchitectureError": "model_path",
    "check_model_path": "model_path",
    "UnsupportedQuantizationError": "source",
    "load_model_source": "source",
    "load_tokenizer": "tokenizer",
}

__all__ = [
    "DEFAULT_MODEL_DIST",
    "DefaultModelMissingError",
    "ModelPathNotFoundError",
    "ModelSource",
    "ModelSourceError",
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedArchitectureError",
    "UnsupportedQuantizationError",
    "check_model_path",
    "default_model_path",
    "load_model_source",
    "load_tokenizer",
]

if TYPE_CHECKING:
    from servelm.model_loader.default_model import (
        DEFAULT_MODEL_DIST,
        DefaultModelMissingError,
        default_model_path,
    )
    from servelm.model_loader.model_path import (
        SUPPORTED_ARCHITECTURES,
        ModelPathNotFoundError,
        ModelSourceError,
        UnsupportedArchitectureError,
        check_model_path,
    )
    from servelm.model_loader.source import ModelSource, UnsupportedQuantizationError, load_model_source
    from servelm.model_loader.tokenizer import load_tokenizer


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
