"""The KV tensors: per-layer K and V storage indexed by token slot (SGLang's memory pool).

Which slot belongs to whom is decided elsewhere, in plain Python (`allocator.PageAllocator`, the prefix
cache); this module only holds the tensors, in the storage dtype of `--kv-cache-dtype`:

* float32, bfloat16, float16: the values rounded to nearest (float16 saturates at +-65504);
* fp8_e4m3, fp8_e5m2 (torch's float8_e4m3fn / float8_e5m2): rounded to nearest and saturated at the
  format's largest finite value (+-448 / +-57344) rather than overflowing to inf or NaN, with no scale
  (vLLM's default k_scale = v_scale = 1);
* int8: per token and KV head, q = round(x / s) with s = amax(|x|) / 127 stored as float16 (saturated, like
  the values; llama.cpp's q8_0 scale, over a whole head instead of 32 values; SGLang's int8 KV is scaled per
  token and head too).

The C++ kernels (`servelm_fused`) write and read the same bits: `encode` here is their reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8")

_STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
# Largest finite value of each float storage: writes saturate there.
_SATURATE = {torch.float16: 65504.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def resolve_kv_dtype(name: str, model_dtype: torch.dtype, device: torch.device, deterministic: bool) -> str:
    """The storage `--kv-cache-dtype NAME` means here. `auto`: the model's dtype on a GPU or where the model is
    not fp32; on a CPU with an fp32 model, bfloat16 where the CPU has AVX-512 BF16 and float16 elsewhere
    (half the bytes of fp32, what llama.cpp keeps by default); fp32 in deterministic mode."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r} is not one of: {', '.join(KV_CACHE_DTYPES)}")
    if name != "auto":
        return name
    if device.type != "cpu" or model_dtype != torch.float32 or deterministic:
        return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(model_dtype, "float32")
    return "bfloat16" if torch.cpu._is_avx512_bf16_supported() else "float16"


def storage_dtype(name: str) -> torch.dtype:
    return _STORAGE[name]


def encode(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., D] in the storage `dtype`: (values, None), or for int8 (codes, float16 scales [...])."""
    if dtype == torch.int8:
        xf = x.float()
        scale = (xf.abs().amax(dim=-1) / 127).clamp_(max=65504.0).to(torch.float16)  # saturated, as below
        s = scale.float().unsqueeze(-1)
        codes = torch.where(s > 0, xf / s, torch.zeros_like(xf)).round_().clamp_(-127, 127).to(torch.int8)
        return codes, scale
    limit = _SATURATE.get(dtype)
    if limit is not None:
        x = x.clamp(-limit, limit)
    return x.to(dtype), None


def raw_view(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as their bytes (torch's CPU index_copy_ has no float8 kernels); others as they are."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _select(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return raw_view(t).index_select(0, index).view(t.dtype)


def decode(values: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `encode`, in `dtype` (exact for the float storages: every stored value is one there)."""
    if scale is None:
        return values.to(dtype)
    return (values.float() * scale.float().unsqueeze(-1)).to(dtype)


@dataclass
class LayerKV:
    """One layer's K and V: storage [slots, Hkv, D] and, for int8, float16 scales [slots, Hkv]."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    compute_dtype: torch.dtype

    def write(self, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, Hkv, D] into slots loc [T]."""
        for store, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            codes, scale = encode(x, store.dtype)
            raw_view(store).index_copy_(0, loc, raw_view(codes))
            if scales is not None:
                scales.index_copy_(0, loc, scale)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slots` [n] as [n, Hkv, D] in the compute dtype."""
        return (decode(_select(self.k, slots), self._scales(self.k_scale, slots), self.compute_dtype),
                decode(_select(self.v, slots), self._scales(self.v_scale, slots), self.compute_dtype))

    def gather_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `rows` [n] of the caches seen as [slots * Hkv, D] (head-major gathers), as [n, D]."""
        D = self.k.shape[-1]

        def one(store: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
            s = None if scales is None else scales.view(-1).index_select(0, rows)
            return decode(_select(store.view(-1, D), rows), s, self.compute_dtype)

        return one(self.k, self.k_scale), one(self.v, self.v_scale)

    @staticmethod
    def _scales(scales: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor | None:
        return None if scales is None else scales.index_select(0, slots)


class KVCache:
    """Per-layer K and V storage indexed by token slot: [layers, slots, kv_heads, head_dim].

    Slot numbers come from the PageAllocator (slot = page * page_size + offset);
    this class only stores tensors and never decides who owns a slot. `dtype` is the
    model's (what reads return); `kv_dtype` the storage, a `KV_CACHE_DTYPES` name
    (default: the model's dtype).
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, kv_dtype: str | None = None) -> None:
        self.kv_dtype = kv_dtype or {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")
        storage = storage_dtype(self.kv_dtype)
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        # NOTE: uninitialised on purpose (zeroing GiBs costs seconds at start-up). Attention only ever
        # reads slots a request wrote: decode padding repeats the row's own first slot, never slot 0.
        self.k = torch.empty(shape, dtype=storage, device=device)
        self.v = torch.empty(shape, dtype=storage, device=device)
        self.k_scale = self.v_scale = None
        if storage == torch.int8:
            self.k_scale = torch.empty(shape[:3], dtype=torch.float16, device=device)
            self.v_scale = torch.empty(shape[:3], dtype=torch.float16, device=device)
        self.num_slots = num_slots
        self.compute_dtype = dtype
        self.layers = [LayerKV(self.k[i], self.v[i], None if self.k_scale is None else self.k_scale[i],
                               None if self.v_scale is None else self.v_scale[i], dtype) for i in range(num_layers)]

    def layer(self, i: int) -> LayerKV:
        return self.layers[i]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype | str) -> int:
        """K and V bytes a token takes over all layers, in a torch dtype or a `KV_CACHE_DTYPES` storage name."""
        storage = storage_dtype(dtype) if isinstance(dtype, str) else dtype
        per_head = head_dim * storage.itemsize + (2 if storage == torch.int8 else 0)
        return 2 * num_layers * num_kv_heads * per_head

    def describe(self) -> dict[str, object]:
        """What the pool holds, for /server_info."""
        return {"kv_cache_dtype": self.kv_dtype, "kv_cache_storage": str(self.k.dtype).removeprefix("torch."),
                "kv_cache_scales": "float16 per token and KV head" if self.k_scale is not None else None,
                "kv_cache_bytes_per_token": self.bytes_per_token(self.k.shape[0], self.k.shape[2], self.k.shape[3],
                                                                 self.kv_dtype)}
