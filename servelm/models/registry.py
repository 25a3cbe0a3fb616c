"""HF `architectures` name -> model class, imported lazily."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("servelm.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("servelm.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("servelm.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("servelm.models.qwen3", "Qwen3ForCausalLM"),
}

SUPPORTED_ARCHITECTURES = tuple(_MODELS)


def resolve_model_class(architectures: list[str] | None) -> type[nn.Module]:
    for arch in architectures or []:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(f"Unsupported model architecture {', '.join(architectures or ['<none>'])}. "
                     f"Supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
