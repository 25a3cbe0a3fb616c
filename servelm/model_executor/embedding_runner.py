"""The model side of an embedding server (`--is-embedding`, `--runner pooling`, or detected): a BERT-family
encoder, its pooling as the model's sentence-transformers files say, one forward per batch of whole inputs.
No KV cache: an input is read once, whole (attention is bidirectional), and forgotten.
"""

from __future__ import annotations

import base64
import logging
import os
import time
from typing import Any

import torch

from servelm.config import ConfigError, ServerArgs
from servelm.model_loader.model_path import ENCODER_ARCHITECTURES
from servelm.model_loader.pooling import PoolingConfig, read_pooling

logger = logging.getLogger(__name__)

class EmbeddingRunner:
    """Owns an encoder and embeds batches of token-id lists."""

    def __init__(self, server_args: ServerArgs, model_path: str) -> None:
        from safetensors import safe_open

        from servelm.model_loader.model_path import read_hf_config
        from servelm.model_loader.safetensors import _weight_files
        from servelm.model_loader.tokenizer import load_tokenizer
        from servelm.models.bert import BertClassifier, BertEncoder

        t0 = time.perf_counter()
        if server_args.tp_size > 1:
            raise ConfigError("an embedding model runs on one rank: --tp-size must be 1")
        if server_args.dtype == "float16":
            raise ConfigError("--dtype float16: embedding models run in float32 (auto) or bfloat16")
        gguf = os.path.isfile(model_path)
        # bfloat16 on request only: 2.5x the speed on a CPU with AVX-512 BF16, at a cosine of ~0.99993 to fp32
        # (docs/embeddings.md); fp32 is what sentence-transformers computes.
        self.dtype = torch.bfloat16 if server_args.dtype == "bfloat16" else torch.float32
        # --quantization as for decoders: a GGUF's projection blocks kept (auto), or every projection quantised
        # at load (int8, q8_0, q4_0, ...); the quantised kernel computes in fp32, so not with bfloat16
        from servelm.model_loader.quantization import resolve_quantization

        policy = resolve_quantization(server_args.quantization, "gguf" if gguf else "hf", self.dtype,
                                      torch.device("cpu"))
        if gguf:  # a llama.cpp BERT GGUF
            from servelm.model_loader import gguf_bert

            raw, architecture = {}, "BertModel"
            self.config = config = gguf_bert.config(model_path)
            # llama.cpp's pooling type; normalised, as llama-server's embeddings are by default
            pooling = PoolingConfig(gguf_bert.pooling_mode(model_path), True, None, "the GGUF metadata")
        else:
            raw, architecture = read_hf_config(model_path)
            if architecture not in ENCODER_ARCHITECTURES:
                raise ConfigError(f"{model_path}: {architecture} as an embedding model is not supported yet "
                                  f"(encoders: {', '.join(ENCODER_ARCHITECTURES)})")
            import transformers

            self.config = config = transformers.AutoConfig.from_pretrained(model_path, local_files_only=True)
            pooling = read_pooling(model_path)
        self.model_path = model_path
        if server_args.pooling is not None:
            pooling = PoolingConfig(server_args.pooling, pooling.normalize, pooling.max_seq_length, "--pooling")
        self.pooling = pooling
        limits = [config.max_position_embeddings, pooling.max_seq_length, server_args.context_length]
        self.max_context_len = min(v for v in limits if v)
        # a cross-encoder scores pairs (its logits come back where an embedding would); an encoder embeds
        self.task = "score" if architecture == "BertForSequenceClassification" else "embed"
        st_config = raw.get("sentence_transformers") if isinstance(raw.get("sentence_transformers"), dict) else {}
        self.activation = st_config.get("activation_fn")  # a cross-encoder's, when its config names one
        self.model = BertClassifier(config) if self.task == "score" else BertEncoder(config)
        with torch.no_grad():
            def tensors() -> Any:
                if gguf:
                    yield from gguf_bert.tensors(model_path, policy.keep_formats)
                    return
                for path, names in _weight_files(model_path).items():
                    with safe_open(path, framework="pt", device="cpu") as f:
                        for name in names:
                            yield name, f.get_tensor(name).to(torch.float32)

            self.model.load_weights(tensors())
            encoder = self.model.encoder if self.task == "score" else self.model
            if policy.target is not None:
                encoder.quantize(policy.target)
        self.model.to(self.dtype).eval()
        self.weight_formats = encoder.weight_formats()
        self.prepacked = not server_args.disable_fast_path and encoder.prepack()
        self.tokenizer = load_tokenizer(server_args.tokenizer_path or model_path, None)
        self.architecture = architecture
        self.hidden_size = config.hidden_size
        # a cross-encoder's head beside its encoder (an embedding model is its encoder: nothing to add)
        self.weight_bytes = encoder.weight_bytes() + (sum(
            p.numel() * p.element_size() for n, p in self.model.named_parameters() if not n.startswith("encoder."))
            if encoder is not self.model else 0)
        logger.info("embedding model %s (%s, %s) loaded in %.1f s: %d dimensions, %s pooling%s (%s), at most %d tokens "
                    "an input; projections %s", model_path, architecture, self.dtype, time.perf_counter() - t0,
                    self.hidden_size, pooling.mode, ", normalised" if pooling.normalize else "", pooling.source,
                    self.max_context_len, ", ".join(f"{n} {f}" for f, n in self.weight_formats.items()))

    @torch.inference_mode()
    def embed(self, seqs: list[list[int]], token_types: list[list[int]] | None = None) -> list[str]:
        """One forward over `seqs` (whole inputs): each one's embedding (a cross-encoder's logits) as base64 of
        float32 little-endian (OpenAI's `encoding_format: base64`, and compact on the scheduler's socket)."""
        from servelm.models.bert import PackedBatch, pool

        batch = PackedBatch.of(seqs, token_types)
        if self.task == "score":
            out = self.model(batch).float()
        else:
            out = pool(self.model(batch).float(), batch.lengths, self.pooling.mode, self.pooling.normalize)
        rows = out.to(torch.float32).contiguous().numpy().astype("<f4")
        return [base64.b64encode(row.tobytes()).decode() for row in rows]

    def model_info(self) -> dict[str, Any]:
        return {"task": self.task, "num_labels": getattr(self.config, "num_labels", None),
                "activation": self.activation,
                "id2label": {str(k): v for k, v in (getattr(self.config, "id2label", None) or {}).items()}
                if self.task == "score" else None,
                "architecture": self.architecture, "dtype": str(self.dtype).removeprefix("torch."),
                "hidden_size": self.hidden_size,
                "embedding_dimensions": self.hidden_size * len(self.pooling.mode.split("+")),
                "pooling": self.pooling.mode, "normalize": self.pooling.normalize,
                "max_context_length": self.max_context_len, "model_context_length": self.max_context_len,
                "vocab_size": self.config.vocab_size, "weight_bytes": self.weight_bytes,
                "weight_formats": self.weight_formats,
                "model_path": self.model_path, "kv_capacity_tokens": 0}
