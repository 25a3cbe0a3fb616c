"""Write a transformers model as a GGUF file the way llama.cpp's converter does (shared by the loader,
quantisation and TP tests)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import transformers

_HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (the forward direction)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    path: Path,
    gguf_arch: str,
    model: transformers.PreTrainedModel,
    *,
    quantize: str | None = None,
    rope_scaling: tuple[str, float, int] | None = None,
    override_dtype: dict[str, np.dtype] | None = None,
) -> None:
    """Write `model` as llama.cpp's converter would (names, q/k permute for llama, metadata)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), gguf_arch)
    w.add_name("tiny")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if rope_scaling:
        kind, factor, original = rope_scaling
        w.add_rope_scaling_type(gguf.RopeScalingType(kind))
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(original)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        parts = name.split(".")
        if name.startswith("model.layers."):
            module, kind = ".".join(parts[3:-1]), parts[-1]
            gguf_name = f"blk.{parts[2]}.{_HF_TO_GGUF_BLOCK[module]}.{kind}"
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]  # fmt: skip
        arr = tensor.float().numpy().copy()
        if gguf_arch == "llama" and ".attn_q." in gguf_name:
            arr = _llama_cpp_permute(arr, cfg.num_attention_heads)
        elif gguf_arch == "llama" and ".attn_k." in gguf_name:
            arr = _llama_cpp_permute(arr, cfg.num_key_value_heads)
        if override_dtype and gguf_name in override_dtype:
            w.add_tensor(gguf_name, arr.astype(override_dtype[gguf_name]))
        elif quantize and arr.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quantize]
            w.add_tensor(gguf_name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
