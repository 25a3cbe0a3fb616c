"""Builds the model, loads its weights, sizes the KV pool, and runs forwards."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from tqdm import tqdm

from servelm.config import ConfigError, ServerArgs
from servelm.layers.batch_invariant import set_batch_invariant
from servelm.layers.sampler import SampleOutput, sample
from servelm.model_executor.forward_batch import ForwardBatch, KVCache, StepInput
from servelm.models.llama import head_dim_of
from servelm.models.registry import resolve_model_class

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was requested but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # This class of CPU has no fast bf16 path; fp32 is both faster and exact.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def resolve_model_path(model_path: str | None) -> str:
    if model_path is not None:
        return model_path
    from servelm.model_loader.default_model import default_model_path

    path = default_model_path()
    logger.info("No --model-path given: serving the embedded default model %s", path)
    return path


def eos_token_ids_of(config: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    for value in (getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and v not in ids:
                ids.append(int(v))
    return ids


class ModelRunner:
    def __init__(self, server_args: ServerArgs) -> None:
        from servelm.model_loader.source import load_model_source
        from servelm.model_loader.tokenizer import load_tokenizer

        t0 = time.perf_counter()
        self.server_args = server_args
        set_batch_invariant(server_args.enable_deterministic_inference)
        self.device = resolve_device(server_args.device)
        self.dtype = resolve_dtype(server_args.dtype, self.device)
        self.model_path = resolve_model_path(server_args.model_path)
        source = load_model_source(self.model_path)
        self.config = config = source.config
        model_cls = resolve_model_class(config.architectures)
        max_positions = server_args.context_length or config.max_position_embeddings
        with torch.device(self.device):
            self.model = model_cls(config, self.dtype, max_positions=max_positions)
        self._load_weights(source)
        self.model.eval()
        self.fast_path = not server_args.disable_fast_path and self.model.prepack_weights() > 0
        self.tokenizer = load_tokenizer(server_args.tokenizer_path or self.model_path, server_args.chat_template)
        self.eos_token_ids = eos_token_ids_of(config, self.tokenizer)
        self.vocab_size = config.vocab_size

        attn = self.model.model.layers[0].self_attn
        bytes_per_token = KVCache.bytes_per_token(config.num_hidden_layers, attn.num_kv_heads, head_dim_of(config),
                                                  self.dtype)
        tokens = self._kv_budget_tokens(bytes_per_token)
        page = server_args.page_size
        self.num_pages = max(tokens // page, 2)
        self.kv_cache = KVCache(config.num_hidden_layers, self.num_pages * page, attn.num_kv_heads,
                                head_dim_of(config), self.dtype, self.device)
        self.max_context_len = min(max_positions, (self.num_pages - 1) * page)
        self.load_seconds = time.perf_counter() - t0
        logger.info("Loaded %s (%s, %s, %s) in %.1f s; KV cache %d tokens (%.2f GiB)", self.model_path,
                    config.architectures[0], str(self.dtype).removeprefix("torch."),
                    "oneDNN pre-packed linears" if self.fast_path else "eager linears", self.load_seconds,
                    self.num_pages * page, self.num_pages * page * bytes_per_token / 2**30)

    def _load_weights(self, source: Any) -> None:
        weights = tqdm(source.iter_weights(self.dtype), total=source.num_weights, desc="Loading weights",
                       unit="tensor", leave=False)
        loaded = self.model.load_weights(weights)
        expected = {n for n, _ in self.model.named_parameters()}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"Checkpoint {self.model_path} lacks weights for: {', '.join(missing[:5])}"
                             + (" ..." if len(missing) > 5 else ""))

    def _kv_budget_tokens(self, bytes_per_token: int) -> int:
        sa = self.server_args
        if sa.max_total_tokens is not None:
            return sa.max_total_tokens
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * sa.mem_fraction_static) // bytes_per_token
        return int(sa.cpu_kv_cache_gb * 2**30) // bytes_per_token

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        fb.kv_cache = self.kv_cache
        return self.model(fb)

    def execute(self, step: StepInput) -> SampleOutput | None:
        """One scheduler step: forward over the mixed batch, then sample its rows."""
        logits = self.forward(step.to_forward_batch(self.device))
        return sample(logits, step.sample_rows) if step.sample_rows else None

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "architecture": self.config.architectures[0],
                "dtype": str(self.dtype).removeprefix("torch."), "device": str(self.device), "fast_path": self.fast_path,
                "load_seconds": round(self.load_seconds, 2)}
