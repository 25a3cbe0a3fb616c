"""Write a transformers model as a GGUF file the way llama.cpp's converter does (shared by the loader,
quantisation and TP tests)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import transformers

from servelm.kernels import quant

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


def _scale_and_min(sub: np.ndarray, top: int, smax: int) -> tuple[np.ndarray, ...]:
    """Plain min/max rounding per sub-block (the last axis) with a minimum, as Q2_K's and Q4_K's: codes 0..top,
    the sub-blocks' scales and minimums integers 0..smax times the super-block's fp16 d and dmin. Returns d,
    dmin, the scales, the minimums and the codes (uint8)."""
    lo = np.minimum(sub.min(-1), 0.0)
    span = (sub.max(-1) - lo) / top
    d = (span.max(-1, keepdims=True) / smax).astype(np.float16)
    dmin = (-lo.min(-1, keepdims=True) / smax).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.round(span / d.astype(np.float32))), 0, smax).astype(np.uint8)
        mn = np.clip(np.nan_to_num(np.round(-lo / dmin.astype(np.float32))), 0, smax).astype(np.uint8)
        step = (d.astype(np.float32) * sc)[..., None]
        q = np.nan_to_num(np.round((sub + (dmin.astype(np.float32) * mn)[..., None]) / step))
    return d, dmin, sc, mn, np.clip(q, 0, top).astype(np.uint8)


def quantize_k(arr: np.ndarray, qtype: str) -> np.ndarray:
    """Q2_K, Q3_K, Q4_K or Q6_K blocks of a float [N, K] array (K a multiple of 256), uint8 [N, bytes_per_row].

    gguf-py dequantises k-quants but cannot write them, so tests write their own: plain min/max (Q2_K, Q4_K) and
    absmax (Q3_K, Q6_K) scales, not llama.cpp's search, in ggml's exact block layout.
    """
    n, k = arr.shape
    x = arr.astype(np.float32).reshape(n * k // 256, 256)
    if qtype == "Q4_K":
        d, dmin, sc, mn, q = _scale_and_min(x.reshape(-1, 8, 32), 15, 63)  # q: [blocks, 8, 32]
        scales = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
                                 (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1)
        qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # sub-block 2c low nibbles, 2c + 1 high ones
        blocks = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), scales, qs], axis=1)
    elif qtype == "Q2_K":  # scales [16] (4-bit scale | 4-bit min << 4), qs [64], fp16 d, dmin
        d, dmin, sc, mn, q = _scale_and_min(x.reshape(-1, 16, 16), 3, 15)
        code = q.reshape(-1, 2, 4, 32)  # element 32 (4 h + s) + l: bits 2 s of
        qs = (code << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(2, dtype=np.uint8)  # 32 h + l
        blocks = np.concatenate([sc | (mn << 4), qs.reshape(-1, 64), d.view(np.uint8), dmin.view(np.uint8)], axis=1)
    elif qtype == "Q6_K":
        sub = x.reshape(-1, 16, 16)
        amax = np.abs(sub).max(-1)
        d = (amax.max(-1, keepdims=True) / 31 / 127).astype(np.float16)
        with np.errstate(divide="ignore", invalid="ignore"):
            sc = np.clip(np.nan_to_num(np.round(amax / 31 / d.astype(np.float32))), -128, 127).astype(np.int8)
            q = np.nan_to_num(np.round(sub / (d.astype(np.float32) * sc)[..., None]))
        q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # [blocks, half, 128]
        ql = (q[:, :, :64] & 15) | ((q[:, :, 64:] & 15) << 4)  # [blocks, 2, 64]
        hi = (q >> 4).reshape(-1, 2, 4, 32)
        qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # [blocks, 2, 32]
        blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8)], axis=1)
    elif qtype == "Q3_K":
        sub = x.reshape(-1, 16, 16)
        amax = np.abs(sub).max(-1)
        d = (amax.max(-1, keepdims=True) / 4 / 31).astype(np.float16)
        with np.errstate(divide="ignore", invalid="ignore"):
            sc = np.clip(np.nan_to_num(np.round(amax / 4 / d.astype(np.float32))), 0, 31).astype(np.int16)
            q = np.nan_to_num(np.round(sub / (d.astype(np.float32) * sc)[..., None]))
        code = (np.clip(q, -4, 3) + 4).astype(np.uint8).reshape(-1, 8, 32)  # [blocks, j, l]: element 32 j + l
        hmask = ((code >> 2) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)  # bit j of l
        low = (code & 3).reshape(-1, 2, 4, 32)  # element 32 (4 h + s) + l: bits 2 s of byte 32 h + l
        qs = (low << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(2, dtype=np.uint8).reshape(-1, 64)
        u = (sc + 32).astype(np.uint8)  # [blocks, 16], 6 bits each
        lsc = (u[:, :8] & 15) | ((u[:, 8:] & 15) << 4)
        hsc = ((u >> 4).reshape(-1, 4, 4) << (2 * np.arange(4, dtype=np.uint8))[None, :, None]).sum(1, dtype=np.uint8)
        blocks = np.concatenate([hmask, qs, lsc, hsc, d.view(np.uint8)], axis=1)
    else:
        raise ValueError(qtype)
    return np.ascontiguousarray(blocks).reshape(n, -1)


def quantize_iq4_nl(arr: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks of a float [N, K] array (K a multiple of 32), uint8 [N, bytes_per_row]: per block of 32,
    d = the largest-magnitude value / -127 (llama.cpp's starting scale, without its search), each weight the
    nearest of the table's 16 values."""
    n, k = arr.shape
    x = arr.astype(np.float32).reshape(-1, 32)
    values = np.array(quant.IQ4_VALUES, np.float32)
    extreme = x[np.arange(len(x)), np.abs(x).argmax(-1)]
    d = (extreme / -127).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.nan_to_num(x / d.astype(np.float32)[:, None])
    q = np.abs(scaled[..., None] - values).argmin(-1).astype(np.uint8)  # [blocks, 32]
    blocks = np.concatenate([d.reshape(-1, 1).view(np.uint8), q[:, :16] | (q[:, 16:] << 4)], axis=1)
    return np.ascontiguousarray(blocks).reshape(n, -1)


def quantize_iq4_xs(arr: np.ndarray) -> np.ndarray:
    """IQ4_XS super-blocks of a float [N, K] array (K a multiple of 256), uint8 [N, bytes_per_row]: each block's
    IQ4_NL scale (`quantize_iq4_nl`) rounded to a 6-bit multiple of the super-block's d, then the nearest table
    values; ggml's layout (d, scales_h, scales_l, 8 x 16 nibble bytes)."""
    n, k = arr.shape
    x = arr.astype(np.float32).reshape(-1, 8, 32)
    values = np.array(quant.IQ4_VALUES, np.float32)
    extreme = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]  # [sb, 8]
    dl = extreme / -127
    d = (np.abs(dl).max(-1, keepdims=True) / 31).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.clip(np.nan_to_num(np.round(dl / d.astype(np.float32))), -32, 31).astype(np.int16)
        scaled = np.nan_to_num(x / (d.astype(np.float32) * ls)[..., None])
    q = np.abs(scaled[..., None] - values).argmin(-1).astype(np.uint8)  # [sb, 8, 32]
    u = (ls + 32).astype(np.uint16)  # 6 bits a block
    scales_h = ((u >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(-1, dtype=np.uint16)
    scales_l = ((u[:, 0::2] & 15) | ((u[:, 1::2] & 15) << 4)).astype(np.uint8)
    qs = (q[..., :16] | (q[..., 16:] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8), scales_h[:, None].view(np.uint8), scales_l, qs], axis=1)
    return np.ascontiguousarray(blocks).reshape(n, -1)


# byte offsets of the fp16 d (and dmin)
_D_AT = {"q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "iq4_nl": (0,),
         "iq4_xs": (0,)}


def random_k_quant(fmt: str, n: int, k: int, seed: int) -> tuple[np.ndarray, quant.QuantWeight]:
    """Random blocks of a format gguf-py cannot quantise (the k-quants, IQ4_NL, IQ4_XS): any scale, min and code bits
    are valid, with fp16 d/dmin in [1e-4, 1e-2]. K not a multiple of the block is padded, as in a file."""
    rng = np.random.default_rng(seed)
    row = quant.block_format(fmt)
    nblk = -(-k // row.file_block)
    blocks = rng.integers(0, 256, size=(n * nblk, quant.bytes_per_block(fmt)), dtype=np.uint8)
    for at in _D_AT[fmt]:
        blocks[:, at: at + 2] = rng.uniform(1e-4, 1e-2, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    raw = blocks.reshape(n, -1)
    return raw, quant.from_gguf(raw, fmt, (n, k))


def write_gguf(
    path: Path,
    gguf_arch: str,
    model: transformers.PreTrainedModel,
    *,
    quantize: str | None = None,
    rope_scaling: tuple[str, float, int] | None = None,
    override_dtype: dict[str, np.dtype] | None = None,
    skip: tuple[str, ...] = (),
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
) -> None:
    """Write `model` as llama.cpp's converter would (names, q/k permute for llama, metadata). `skip`: gguf
    tensor names left out; `extra` adds metadata or tensors of its own before the file is written."""
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
    rope = cfg.rope_parameters or {}
    if rope.get("rope_type") == "llama3":  # llama.cpp's converter: per-frequency divisors, no scaling metadata
        from servelm.model_loader.gguf import llama3_freq_factors

        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        w.add_rope_dimension_count(head_dim)
        w.add_tensor("rope_freqs.weight", llama3_freq_factors(
            rope["rope_theta"], head_dim, rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
            rope["original_max_position_embeddings"]))
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
        if gguf_name in skip:
            continue
        arr = tensor.float().numpy().copy()
        if gguf_arch == "llama" and ".attn_q." in gguf_name:
            arr = _llama_cpp_permute(arr, cfg.num_attention_heads)
        elif gguf_arch == "llama" and ".attn_k." in gguf_name:
            arr = _llama_cpp_permute(arr, cfg.num_key_value_heads)
        if override_dtype and gguf_name in override_dtype:
            w.add_tensor(gguf_name, arr.astype(override_dtype[gguf_name]))
        elif quantize == "Q4_K_M" and arr.ndim == 2:  # as llama.cpp's mix: Q6_K for the embedding/output and
            # some layers' attn_v (its "use_more_bits" layers; here layer 0), Q4_K elsewhere; a row that is not
            # whole 256-weight super-blocks falls back as llama-quantize does (Q4_K -> Q5_0, Q6_K -> Q8_0)
            qtype = "Q6_K" if gguf_name in ("token_embd.weight", "output.weight", "blk.0.attn_v.weight") else "Q4_K"
            if arr.shape[-1] % 256:
                qt = gguf.GGMLQuantizationType.Q8_0 if qtype == "Q6_K" else gguf.GGMLQuantizationType.Q5_0
                w.add_tensor(gguf_name, gguf.quants.quantize(arr, qt), raw_dtype=qt)
            else:
                w.add_tensor(gguf_name, quantize_k(arr, qtype), raw_dtype=gguf.GGMLQuantizationType[qtype])
        elif quantize in ("Q3_K_M", "Q2_K") and arr.ndim == 2:  # llama.cpp's mixes, simplified: Q6_K for the
            # embedding and output, Q4_K (Q2_K: Q3_K) for attn_v and ffn_down, Q3_K (Q2_K) elsewhere; rows not whole
            # super-blocks fall back as llama-quantize's fallback table says (Q2_K, Q3_K -> IQ4_NL, Q4_K -> Q5_0,
            # Q6_K -> Q8_0; the 11434 build wrote Q4_0 instead of IQ4_NL for the Qwen2.5-0.5B shape's Q3_K_M, a
            # format covered elsewhere)
            low, more = ("Q3_K", "Q4_K") if quantize == "Q3_K_M" else ("Q2_K", "Q3_K")
            qtype = "Q6_K" if gguf_name in ("token_embd.weight", "output.weight") else \
                more if (".attn_v." in gguf_name or ".ffn_down." in gguf_name) else low
            if arr.shape[-1] % 256 and qtype in ("Q2_K", "Q3_K"):
                w.add_tensor(gguf_name, quantize_iq4_nl(arr), raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
            elif arr.shape[-1] % 256:
                qt = gguf.GGMLQuantizationType.Q8_0 if qtype == "Q6_K" else gguf.GGMLQuantizationType.Q5_0
                w.add_tensor(gguf_name, gguf.quants.quantize(arr, qt), raw_dtype=qt)
            else:
                w.add_tensor(gguf_name, quantize_k(arr, qtype), raw_dtype=gguf.GGMLQuantizationType[qtype])
        elif quantize in ("IQ4_NL", "IQ4_XS") and arr.ndim == 2:  # gguf-py cannot write them either; IQ4_XS
            # rows that are not whole 256-weight super-blocks fall back to IQ4_NL, as llama-quantize's do
            if quantize == "IQ4_XS" and arr.shape[-1] % 256 == 0:
                w.add_tensor(gguf_name, quantize_iq4_xs(arr), raw_dtype=gguf.GGMLQuantizationType.IQ4_XS)
            else:
                w.add_tensor(gguf_name, quantize_iq4_nl(arr), raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
        elif quantize and arr.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quantize]
            w.add_tensor(gguf_name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, arr)
    if extra is not None:
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
