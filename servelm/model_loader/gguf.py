"""GGUF files (llama.cpp format): config from metadata, dequantised weights under HF names.

The `gguf` package memory-maps the file; each tensor is dequantised (numpy, float32) only when
`iter_weights` reaches it, then cast to the requested dtype; Q8_0/Q4_0/Q4_1 tensors can instead come as
their raw blocks (`QuantWeight`, see `servelm.model_loader.quantization`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from servelm.kernels import quant
from servelm.kernels.quant import QuantWeight
from servelm.model_loader.base import ModelSource, UnsupportedQuantizationError
from servelm.model_loader.model_path import ModelSourceError, UnsupportedArchitectureError

logger = logging.getLogger(__name__)

# GGUF `general.architecture` -> (HF architecture, transformers config class name).
# NOTE: llama.cpp converts Mistral checkpoints to arch "llama" (without sliding-window metadata, and
# llama.cpp runs them with full attention), so they load as LlamaForCausalLM, which computes the same.
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
}

# llama.cpp's convert_hf_to_gguf.py permutes the q/k rows of these archs (GPT-J style rotary halves
# interleaved), so we must undo it to get back HF's rotate-half layout.
_PERMUTED_QK_ARCHS = frozenset({"llama"})

EMBEDDING_NAME = "model.embed_tokens.weight"
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors llama.cpp derives from the config that HF models recompute themselves.
_SKIPPED_TENSORS = {"rope_freqs.weight"}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str | None:
    """Map a GGUF tensor name (e.g. "blk.3.attn_q.weight") to its HF name; None if unknown."""
    if m := _BLOCK_RE.match(name):
        layer, part, kind = m.groups()
        hf = _BLOCK_TENSORS.get(part)
        return f"model.layers.{layer}.{hf}.{kind}" if hf else None
    if m := _GLOBAL_RE.match(name):
        part, kind = m.groups()
        hf = _GLOBAL_TENSORS.get(part)
        return f"{hf}.{kind}" if hf else None
    return None


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for `n_head` heads (weight [out, in] or bias [out]).

    llama.cpp stores each head's rows as interleaved pairs (x0, x_half, x1, x_half+1, ...):
    rows viewed as [n_head, 2, head_dim/2] were transposed to [n_head, head_dim/2, 2]. We view them
    as [n_head, head_dim/2, 2] and transpose back.
    """
    rows = weight.shape[0]
    half = rows // n_head // 2
    # [rows, *in] -> [n_head, half, 2, *in] -> [n_head, 2, half, *in] -> [rows, *in]
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _scalar(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return value.item() if isinstance(value, np.generic) else value


def _rope_parameters(reader: GGUFReader, arch: str, tensor_names: set[str]) -> dict[str, Any]:
    """RoPE settings in transformers' `rope_parameters` form (rope_theta + scaling keys)."""
    theta = float(_scalar(reader, f"{arch}.rope.freq_base", 10000.0))
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = _scalar(reader, f"{arch}.rope.scaling.type")
    factor = _scalar(reader, f"{arch}.rope.scaling.factor")
    if scaling in ("linear", "yarn") and factor is not None and float(factor) != 1.0:
        params["rope_type"] = scaling
        params["factor"] = float(factor)
        original = _scalar(reader, f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            params["original_max_position_embeddings"] = int(original)
        if scaling == "yarn":
            for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
                v = _scalar(reader, f"{arch}.rope.scaling.{gguf_key}")
                if v is not None:
                    params[hf_key] = float(v)
    elif scaling not in (None, "none", "linear", "yarn"):
        raise ModelSourceError(f"Unsupported GGUF rope scaling type {scaling!r} ({arch}.rope.scaling.type).")
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1+ files keep their llama3 rope scaling as per-frequency divisors (llama.cpp's converter
        # writes 1 / the smoothed factor per frequency, and no scaling metadata).
        head_dim = _scalar(reader, f"{arch}.rope.dimension_count")
        tensor = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        factors = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
        params.update(_llama3_from_freq_factors(factors, theta, int(head_dim or 2 * factors.size)))
    return params


# (low_freq_factor, high_freq_factor, original_max_position_embeddings) of the llama3 scalings in use
# (Llama 3.1 and 3.2: 1, 4, 8192), tried in order to name a rope_freqs tensor's scaling.
_LLAMA3_CANDIDATES = [(1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 4.0, 16384), (1.0, 2.0, 8192), (2.0, 4.0, 8192)]


def llama3_freq_factors(theta: float, head_dim: int, factor: float, low: float, high: float,
                        original: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py rope_freqs for a llama3 scaling: the divisor of each frequency."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    wavelen = 2 * np.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    out = np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor,
                                                             1 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def _llama3_from_freq_factors(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """transformers' llama3 rope parameters that give `factors`, or else the divisors themselves
    (`freq_factors`, which servelm's RotaryEmbedding applies as llama.cpp does)."""
    factor = float(factors.max())
    if factors.size * 2 == head_dim and factor >= 1.0:
        for low, high, original in _LLAMA3_CANDIDATES:
            if np.allclose(llama3_freq_factors(theta, head_dim, factor, low, high, original), factors, rtol=1e-5):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                        "original_max_position_embeddings": original}
    logger.info("GGUF rope_freqs is no llama3 scaling servelm knows by its parameters; its %d divisors are "
                "applied as they are", factors.size)
    return {"freq_factors": [float(f) for f in factors]}


_POOLING_RANK = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK


def _check_rank_head(reader: GGUFReader, arch: str, path: str) -> None:
    """llama.cpp writes a decoder reranker (Qwen3-Reranker) with its LM head's `yes` and `no` rows as a 2-row
    `cls.output` head and, for an untied model (Qwen3-Reranker-4B/8B), without the LM head itself. Loading that
    as tied to the embeddings would score with the embedding's rows: refuse it. A tied model's file (0.6B)
    keeps everything servelm scores with (its `cls.output` rows are the embedding's `yes` and `no` rows)."""
    tensors = {t.name: t for t in reader.tensors}
    cls_out, embd = tensors["cls.output.weight"], tensors.get("token_embd.weight")
    labels = list(_scalar(reader, f"{arch}.classifier.output_labels", None) or [])
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = list(tokens.contents()) if tokens is not None else []
    rows = [vocab.index(label) for label in labels if label in vocab]
    same = False
    if embd is not None and len(rows) == len(labels) == int(cls_out.shape[1]):
        def values(t: Any, sel: Any) -> np.ndarray:
            data = np.asarray(t.data)[sel]
            out = data if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) else \
                dequantize(data, t.tensor_type)
            return np.asarray(out, dtype=np.float32).reshape(len(rows), -1)

        head, mine = values(cls_out, slice(None)), values(embd, rows)
        cos = (head * mine).sum(-1) / (np.linalg.norm(head, axis=-1) * np.linalg.norm(mine, axis=-1) + 1e-30)
        same = bool((cos >= 0.99).all())
    if not same:
        raise ModelSourceError(
            f"GGUF file {path} is llama.cpp's conversion of a reranker (pooling type rank, a {cls_out.shape[1]}-row "
            f"cls.output head for labels {labels}) without its LM head; servelm scores such rerankers "
            "(/v1/rerank, /v1/score) from the LM head's yes/no rows and cannot generate without it: load the "
            "model's Hugging Face folder, or a GGUF converted from it as a plain causal LM.")


def gguf_config(reader: GGUFReader, path: str = "") -> transformers.PretrainedConfig:
    """Build the transformers config (LlamaConfig, Qwen2Config, Qwen3Config) from GGUF metadata."""
    arch = _scalar(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(str(arch), f"GGUF general.architecture of {path}")
    hf_arch, config_cls_name = GGUF_ARCHITECTURES[arch]
    tensor_names = {t.name for t in reader.tensors}

    def need(key: str) -> Any:
        value = _scalar(reader, f"{arch}.{key}")
        if value is None:
            raise ModelSourceError(f"GGUF file {path} lacks required metadata {arch}.{key}.")
        return value

    if (_scalar(reader, f"{arch}.pooling_type") == _POOLING_RANK and "cls.output.weight" in tensor_names
            and "output.weight" not in tensor_names):
        _check_rank_head(reader, arch, path)
    hidden = int(need("embedding_length"))
    n_head = int(need("attention.head_count"))
    n_kv = int(_scalar(reader, f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(_scalar(reader, f"{arch}.attention.key_length", hidden // n_head))
    vocab = _scalar(reader, f"{arch}.vocab_size")
    if vocab is None:
        if "tokenizer.ggml.tokens" in reader.fields:
            vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
        else:
            embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
            vocab = int(embd.shape[1])  # ne order: [hidden, vocab]

    kwargs: dict[str, Any] = dict(
        architectures=[hf_arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        max_position_embeddings=int(_scalar(reader, f"{arch}.context_length", 2048)),
        rms_norm_eps=float(_scalar(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_scalar(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_scalar(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_scalar(reader, "tokenizer.ggml.padding_token_id"),
        rope_parameters=_rope_parameters(reader, arch, tensor_names),
    )
    if arch == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        kwargs["mlp_bias"] = "blk.0.ffn_gate.bias" in tensor_names
    elif arch == "qwen3":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    config_cls = getattr(transformers, config_cls_name)
    return config_cls(**kwargs)


def _check_dequantizable(reader: GGUFReader, path: str) -> None:
    """Raise UnsupportedQuantizationError early (not halfway through loading) for unknown types."""
    seen: set[GGMLQuantizationType] = set()
    for t in reader.tensors:
        if t.tensor_type in seen:
            continue
        seen.add(t.tensor_type)
        try:
            # One row is enough to know whether the gguf package implements this type.
            dequantize(t.data[:1] if t.data.ndim > 1 else t.data, t.tensor_type)
        except NotImplementedError:
            raise UnsupportedQuantizationError(t.tensor_type.name, t.name, path) from None


@dataclass
class GGUFModelSource(ModelSource):
    """A GGUF file opened with `gguf.GGUFReader` (memory-mapped)."""

    reader: GGUFReader | None = field(default=None, repr=False)
    # (gguf tensor name, hf name) in file order; tensors we skip are not in it.
    name_map: list[tuple[str, str]] = field(default_factory=list, repr=False)

    def iter_weights(self, dtype: torch.dtype, keep_formats: frozenset[str] = frozenset(),
                     embedding_formats: frozenset[str] = frozenset()
                     ) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
        """Yield `(hf_name, tensor)`: dequantised to float32, q/k un-permuted, then cast to `dtype`.

        A 2-D tensor whose ggml type is in `keep_formats` (kernel format names, `quant.FORMATS`: "q8_0",
        "q4_0", ..., "q6_k") comes as a `QuantWeight` of the file's blocks instead, never through fp32 (q/k rows
        un-permuted; the k-quants' bits rearranged into 32-weight blocks, the same bits); so does the embedding
        (`model.embed_tokens.weight`) alone when its type is in `embedding_formats`.
        """
        assert self.reader is not None
        tensors = {t.name: t for t in self.reader.tensors}
        widened: dict[str, list[int]] = {}  # ggml type -> [matrices, fp32 bytes] of 2-D tensors not kept
        for gguf_name, hf_name in self.name_map:
            t = tensors[gguf_name]
            # GGUF shapes are in ggml `ne` order (fastest dim first): reversed relative to torch.
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            fmt = t.tensor_type.name.lower()
            heads = self._permuted_heads(gguf_name)
            if len(shape) == 2 and (fmt in keep_formats or (fmt in embedding_formats
                                                            and hf_name == EMBEDDING_NAME)):
                qw = quant.from_gguf(t.data, fmt, shape)
                if heads:
                    qw = quant.permute_rows(qw, torch.from_numpy(unpermute_qk(np.arange(shape[0]), heads)))
                yield hf_name, qw
                continue
            if keep_formats and len(shape) == 2:
                cost = widened.setdefault(t.tensor_type.name, [0, 0])
                cost[0] += 1
                cost[1] += 4 * int(np.prod(shape))
            arr = dequantize(t.data, t.tensor_type).reshape(shape)
            if heads:
                arr = unpermute_qk(arr, heads)
            if not arr.flags.writeable:
                # F32 tensors come back as views of the read-only memory map.
                arr = arr.copy()
            tensor = torch.from_numpy(np.ascontiguousarray(arr))
            yield hf_name, tensor.to(dtype).contiguous()
        for type_name, (count, nbytes) in widened.items():
            logger.info("GGUF tensor type %s is not kept at its own bits: %d matri%s dequantised to fp32 (%.1f MB)",
                        type_name, count, "x" if count == 1 else "ces", nbytes / 1e6)

    def _permuted_heads(self, gguf_name: str) -> int:
        """The head count whose q/k row permutation llama.cpp applied to this tensor (0: not permuted)."""
        if _scalar(self.reader, "general.architecture") not in _PERMUTED_QK_ARCHS:
            return 0
        if ".attn_q." in gguf_name:
            return self.config.num_attention_heads
        if ".attn_k." in gguf_name:
            return self.config.num_key_value_heads
        return 0


class FastGGUFReader(GGUFReader):
    """gguf-py's reader, reading its fields through a plain ndarray view of the memory map.

    Its `_get` slices `np.memmap`, whose `__getitem__` and `__array_finalize__` run in Python for each of the
    ~1.5M slices a 128k-token vocabulary takes: 7.4 s of a 1B Llama's 18.8 s load here. Slices of a plain
    ndarray over the same mapping are the same values (and still backed by the file) without that overhead.
    """

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:  # the first call: gguf-py's __init__ has mapped self.data and parses from here on
            plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
        count = int(count)
        dt = np.dtype(dtype)
        arr = plain[offset: offset + dt.itemsize * count].view(dt)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def load_gguf_source(path: str) -> GGUFModelSource:
    """Open a .gguf file: parse metadata into a HF config and index its tensors under HF names."""
    try:
        reader = FastGGUFReader(path)
    except (ValueError, OSError) as e:
        raise ModelSourceError(f"Cannot read GGUF file {path}: {e}") from e
    config = gguf_config(reader, path)
    _check_dequantizable(reader, path)
    name_map: list[tuple[str, str]] = []
    # a reranker's cls.output rows (checked in gguf_config) are the LM head's: scored from the head itself
    rank = _scalar(reader, f"{_scalar(reader, 'general.architecture')}.pooling_type") == _POOLING_RANK
    for t in reader.tensors:
        if t.name in _SKIPPED_TENSORS or (rank and t.name == "cls.output.weight"):
            continue
        hf_name = gguf_to_hf_name(t.name)
        if hf_name is None:
            raise ModelSourceError(
                f"GGUF tensor {t.name!r} in {path} has no HF equivalent for {config.architectures[0]}; "
                "the file may be a different model type than its general.architecture says."
            )
        name_map.append((t.name, hf_name))
    return GGUFModelSource(
        path=path, format="gguf", config=config, num_weights=len(name_map), reader=reader, name_map=name_map
    )
