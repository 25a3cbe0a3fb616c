"""Where a model's config and weights come from: a GGUF file or a Hugging Face folder.

`load_model_source(path)` reads only metadata (config, tensor index); the weights are produced lazily,
one tensor at a time, by `ModelSource.iter_weights(dtype)` so that a model runner can copy (and shard)
each one into its parameters without holding two copies of the model in memory.
"""

from __future__ import annotations

# Re-exported: the shared types live in base.py (the sources import them from there), the torch-free path
# checks in model_path.py.
from servelm.model_loader.base import ModelSource, UnsupportedQuantizationError  # noqa: F401
from servelm.model_loader.model_path import (  # noqa: F401
    SUPPORTED_ARCHITECTURES,
    ModelPathNotFoundError,
    ModelSourceError,
    UnsupportedArchitectureError,
    check_architecture,
    resolve_model_path,
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
