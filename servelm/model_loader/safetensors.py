"""Hugging Face model folders: config.json via AutoConfig, weights from (sharded) safetensors.

Tensors are read lazily, one at a time, through `safetensors.safe_open` (memory-mapped).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import transformers
from safetensors import safe_open

from servelm.model_loader.base import ModelSource
from servelm.model_loader.model_path import SAFETENSORS_FILE, SAFETENSORS_INDEX_FILE, ModelSourceError, read_hf_config

SINGLE_FILE = SAFETENSORS_FILE
INDEX_FILE = SAFETENSORS_INDEX_FILE

def _weight_files(folder: str) -> dict[str, list[str]]:
    """Map each safetensors file (absolute path) to its tensor names, in file order."""
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files: dict[str, list[str]] = {}
        for name, filename in weight_map.items():
            files.setdefault(os.path.join(folder, filename), []).append(name)
        missing = [p for p in files if not os.path.isfile(p)]
        if missing:
            raise ModelSourceError(f"{index_path} names shard(s) that are missing: {', '.join(missing)}")
        return files
    single = os.path.join(folder, SINGLE_FILE)
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as f:
            return {single: list(f.keys())}
    raise ModelSourceError(
        f"Model folder {folder} has no {SINGLE_FILE} or {INDEX_FILE}; only safetensors weights are "
        "supported (convert *.bin checkpoints with transformers' save_pretrained(safe_serialization=True))."
    )


@dataclass
class SafetensorsModelSource(ModelSource):
    """A HF folder with config.json and model.safetensors (or a sharded index)."""

    # safetensors file -> tensor names in it
    files: dict[str, list[str]] = field(default_factory=dict, repr=False)

    def iter_weights(self, dtype: torch.dtype, keep_formats: frozenset[str] = frozenset(),
                     embedding_formats: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(hf_name, tensor)` for every tensor of every shard, cast to `dtype` (no quantised blocks here:
        `keep_formats` and `embedding_formats` have nothing to keep)."""
        for path, names in self.files.items():
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in names:
                    yield name, f.get_tensor(name).to(dtype).contiguous()


def load_hf_source(folder: str) -> SafetensorsModelSource:
    """Open a HF model folder: AutoConfig (local files only) and the safetensors tensor index."""
    config_path = os.path.join(folder, "config.json")
    # The architecture is checked before AutoConfig, which fails obscurely on model types it does not know.
    _, architecture = read_hf_config(folder)
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except (ValueError, OSError, KeyError) as e:
        raise ModelSourceError(f"Cannot read {config_path}: {e}") from e
    config.architectures = [architecture]
    files = _weight_files(folder)
    return SafetensorsModelSource(
        path=folder,
        format="hf",
        config=config,
        num_weights=sum(len(v) for v in files.values()),
        files=files,
    )
