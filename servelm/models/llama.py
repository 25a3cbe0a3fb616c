"""Llama-family decoder (Llama 2/3, SmolLM/SmolLM2, Mistral); Qwen2/Qwen3 reuse it.

Mirrors transformers' modeling_llama. Parameter names are HF's, except that
q/k/v and gate/up are fused; `load_weights` maps the HF names onto them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from servelm.config import ConfigError
from servelm.kernels import quant
from servelm.kernels.quant import QuantWeight
from servelm.layers import fused
from servelm.layers.attention import PagedAttention
from servelm.layers.batch_invariant import silu_and_mul
from servelm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from servelm.layers.kernel_choice import kernels_of
from servelm.layers.layernorm import RMSNorm
from servelm.layers.linear import MergedColumnParallelLinear, PrepackMixin, QKVParallelLinear, RowParallelLinear
from servelm.layers.logits import LogitsProcessor
from servelm.layers.rotary import RotaryEmbedding
from servelm.model_executor.forward_batch import ForwardBatch


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    qkv_bias = False
    qk_norm = False

    def __init__(self, config: PretrainedConfig, layer_id: int, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        bias = getattr(config, "attention_bias", False) or self.qkv_bias
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias, dtype=dtype)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=getattr(config, "attention_bias", False) and not self.qkv_bias,
                                        dtype=dtype)
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, layer_id)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        if (not self.qk_norm and fb.kv_cache is not None
                and fused.available(qkv, self.rotary.cos, kernels=kernels_of(self))
                and fused.kv_available(kv := fb.kv_cache.layer(self.attn.layer_id))):
            # split, rotary and the KV-cache write in one C++ op
            q = fused.qkv_rotary_cache(qkv, positions, self.rotary.cos, self.rotary.sin, kv, fb.out_cache_loc,
                                       self.num_heads)
            return self.o_proj(self.attn.forward_cached(q, kv, fb))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # [T, H*D] -> [T, H, D]
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, fb))


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, dtype: torch.dtype) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"Unsupported activation '{config.hidden_act}'; only silu is implemented")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       bias=getattr(config, "mlp_bias", False), dtype=dtype)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                           bias=getattr(config, "mlp_bias", False), dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        kernels = kernels_of(self)
        if fused.available(gate_up, kernels=kernels):
            return self.down_proj(fused.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(silu_and_mul(gate, up, kernels.deterministic))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, config: PretrainedConfig, layer_id: int, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_id, rotary, dtype)
        self.mlp = LlamaMLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self._fused_args: tuple | None = None  # (fused_decode_args(),) once built
        self.fused_tiles_from: dict[str, list[int]] = {}  # kernel path -> fused.decode_layer's tile thresholds

    def fused_decode_args(self) -> tuple[list, list[int], list[int], list, list[str]] | None:
        """The layer's quantised projections as `fused.decode_layer` takes them, or None where this layer's
        decode step cannot be one C++ call: a projection in fp32 (its oneDNN matmul), tensor parallelism (the
        all-reduces), q/k norms (Qwen3), inputs that are not whole blocks (the Python path pads them), or no
        kernel library. Built once, after loading (the weights are fixed from then on)."""
        if self._fused_args is None:
            self._fused_args = (self._build_fused_args(),)
        return self._fused_args[0]

    def _build_fused_args(self) -> tuple[list, list[int], list[int], list, list[str]] | None:
        attn, mlp = self.self_attn, self.mlp
        if attn.qk_norm or not fused.loaded() or kernels_of(self).quant == "torch":
            return None
        weights: list = []
        fmts: list[int] = []
        names: list[str] = []  # the parts' formats by name (their tile thresholds, `quant.tiles_min_rows`)
        parts: list[int] = []
        biases: list = []
        for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            qws = [proj.qweight] if proj.qweight is not None else proj.qweight_parts
            if not qws or proj.tp_size != 1 or proj.in_features % quant.BLOCK:
                return None
            for qw in qws:
                weights.extend(qw.tensors())
                fmts.append(quant.block_format(qw.fmt).code)
                names.append(qw.fmt)
            parts.append(len(qws))
            bias = proj.bias
            if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
                return None
            biases.append(None if bias is None else bias.data)
        for norm in (self.input_layernorm, self.post_attention_layernorm):
            if norm.weight.dtype != torch.float32:
                return None
        return weights, fmts, parts, biases, names

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if (fb.is_decode and fb.kv_cache is not None and fused.available(hidden, kernels=kernels_of(self))
                and fused.kv_available(fb.kv_cache.layer(self.self_attn.attn.layer_id))):
            args = self.fused_decode_args()
            if args is not None:  # the whole step in one C++ call: the same kernels, the same bits
                return fused.decode_layer(self, args, positions, hidden, residual, fb, kernels_of(self).quant)
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, fb)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    layer_cls = LlamaDecoderLayer

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        rotary = RotaryEmbedding(config, head_dim_of(config), max_positions)
        self.layers = nn.ModuleList(self.layer_cls(config, i, rotary, dtype) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(fb.input_ids)
        stack = self._fused_stack(fb, hidden) if fb.is_decode and fb.kv_cache is not None else None
        if stack is not None:  # every layer's step from one C++ call, as each layer would make it
            hidden, residual = fused.decode_stack(stack, fb.positions, hidden, fb)
        else:
            residual = None
            for layer in self.layers:
                hidden, residual = layer(fb.positions, hidden, residual, fb)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def _fused_stack(self, fb: ForwardBatch, hidden: torch.Tensor) -> Any:
        """A `DecodeStack` (`fused.decode_stack_of`) of every layer's `fused.decode_layer_static` when each layer's
        decode step would be its one fused call (`LlamaDecoderLayer.forward`'s checks, made once per KV cache and
        kernel choices), else None."""
        kernels = [kernels_of(layer) for layer in self.layers]
        if not kernels[0].fused or hidden.device.type != "cpu":  # before anything would load the C++ library
            return None
        key = (fb.kv_cache, kernels)
        cached = self.__dict__.get("_fused_stack_cache")
        if cached is not None and cached[0][0] is key[0] and cached[0][1] == kernels:
            stack = cached[1]
            return stack if stack is not None and fused.available(hidden, kernels=kernels[0]) else None
        statics = []
        for layer, k in zip(self.layers, kernels, strict=True):
            kv = fb.kv_cache.layer(layer.self_attn.attn.layer_id)
            args = layer.fused_decode_args() if type(layer).forward is LlamaDecoderLayer.forward else None
            if args is None or not fused.available(hidden, kernels=k) or not fused.kv_available(kv):
                statics = None
                break
            statics.append(fused.decode_layer_static(layer, args, kv, k.quant))
        stack = fused.decode_stack_of(statics) if statics is not None else None
        self.__dict__["_fused_stack_cache"] = (key, stack)
        return stack


class LlamaForCausalLM(nn.Module):
    model_cls = LlamaModel
    # HF checkpoint name fragment -> (fused parameter fragment, shard id)
    stacked_params = (
        (".q_proj.", ".qkv_proj.", 0), (".k_proj.", ".qkv_proj.", 1), (".v_proj.", ".qkv_proj.", 2),
        (".gate_proj.", ".gate_up_proj.", 0), (".up_proj.", ".gate_up_proj.", 1),
    )

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype = torch.float32,
                 max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, dtype, max_positions or config.max_position_embeddings)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = (self.model.embed_tokens if self.tie_word_embeddings
                        else ParallelLMHead(config.vocab_size, config.hidden_size, dtype))
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def forward(self, fb: ForwardBatch, gather_logits: bool = True) -> torch.Tensor:
        """Returns fp32 logits [R, vocab] for the rows in fb.logits_indices (this rank's vocab shard
        [R, V_padded/tp] with gather_logits=False)."""
        hidden = self.model(fb)
        return self.logits_processor(hidden[fb.logits_indices], self.lm_head, gather=gather_logits)

    def prepack_weights(self) -> int:
        """Switch every linear layer and the LM head to oneDNN pre-packed weights; returns how many."""
        count = sum(1 for m in self.modules() if hasattr(m, "prepack") and m is not self.logits_processor
                    and m.prepack())
        return count + int(self.logits_processor.prepack(self.lm_head))

    def finish_loading(self, fp32_lm_head: bool = False) -> None:
        """After the last weight: layers whose shards all came quantised keep them as their one weight.

        fp32_lm_head: the LM head computes in fp32 (`--quantization none`); a tied embedding that came as blocks
        (the policy's `lookup_formats`) keeps them for its lookup alone, see `keep_blocks_for_lookup`."""
        for m in self.modules():
            if isinstance(m, PrepackMixin):
                m.finish_loading()
        if fp32_lm_head and self.tie_word_embeddings:
            self.model.embed_tokens.keep_blocks_for_lookup()

    def weight_matrices(self) -> list[tuple[str, int]]:
        """(format, resident bytes) of each weight matrix this rank holds: "q4_1"..., or the fp32 dtype name
        ("float32", packed by oneDNN or plain; a tied fp32 embedding whose lookup reads blocks counts them and
        the packed LM-head copy, see `VocabParallelEmbedding.keep_blocks_for_lookup`)."""
        out = []
        for m in self.modules():
            if m is self.logits_processor:
                continue
            qweight = getattr(m, "qweight", None)
            if qweight is not None:
                out.append((qweight.fmt, qweight.nbytes))
            elif getattr(m, "qweight_parts", None) is not None:  # shards in different formats: one entry each
                out.extend((part.fmt, part.nbytes) for part in m.qweight_parts)
            elif isinstance(m, (PrepackMixin, VocabParallelEmbedding)):
                weight, packed = m.weight, getattr(m, "packed", None)
                if m is self.lm_head:
                    packed = self.logits_processor.packed
                tensors = [t for t in (weight, packed) if t is not None]
                lookup = getattr(m, "lookup_qweight", None)
                out.append((str(tensors[0].dtype).removeprefix("torch."),
                            sum(t.numel() * t.element_size() for t in tensors) + (lookup.nbytes if lookup else 0)))
        return out

    def weight_bytes(self) -> int:
        """Resident bytes of every weight this rank holds (matrices in any format, norms, biases)."""
        small = sum(p.numel() * p.element_size() for p in self.parameters() if p.dim() == 1)
        return small + sum(b for _, b in self.weight_matrices())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantWeight]]) -> set[str]:
        """Copy HF-named tensors into this rank's shards; returns the names of parameters loaded."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            hf_name = name
            if "rotary_emb.inv_freq" in name:
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            shard_id = None
            for hf_part, fused_part, sid in self.stacked_params:
                if hf_part in name:
                    name, shard_id = name.replace(hf_part, fused_part), sid
                    break
            if name not in params:
                raise ValueError(f"Checkpoint tensor '{name}' has no matching parameter in {type(self).__name__}")
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(quant.dequantize(tensor) if isinstance(tensor, QuantWeight) else tensor)
            else:
                try:
                    loader(param, tensor, shard_id)
                except ConfigError as e:  # a TP split that cuts a block: say which tensor
                    raise ConfigError(f"{hf_name}: {e}") from None
            loaded.add(name)
        return loaded


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama-shaped; sliding-window attention is not applied (full attention)."""
