"""`--quantization`: which weights stay (or become) ggml blocks (`servelm.kernels.quant`), which are fp32.

* auto: a GGUF keeps every 2-D tensor whose type the kernel reads (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K,
  Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS: `quant.FORMATS`) at its own bits, without an fp32 round trip (the super-blocks'
  bits rearranged into 32-weight blocks); other types (F16, other IQ*, ...) are dequantised to fp32
  as with `none`, with one log line per type saying what that costs. A HF folder stays fp32.
* none: everything computes in fp32 from the dequantised weights (the behaviour before quantised kernels).
  One exception in storage, not in values: a GGUF's tied embedding in a kernel format (`lookup_formats`)
  keeps its blocks for the lookup, whose rows dequantise to bitwise the fp32 values `none` held before, while
  the LM head gets the fp32 matrix pre-packed for oneDNN; the embedding is then held as blocks (0.14-0.27x
  fp32) plus one packed fp32 copy, not as a plain and a packed fp32 copy (issue 13).
* int8, q8_0, q4_0, q4_1, q5_0, q5_1: every 2-D weight (the linears, the embedding, the LM head) becomes blocks of that
  format at load; a GGUF tensor already in it is kept as it is, any other is dequantised, then quantised.
  int8 is q8_0: weight-only int8 in groups of 32 with an fp16 scale each.

Quantised weights compute in fp32 activations, so they need `--dtype float32` on the CPU; `auto` falls back
to `none` elsewhere.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from servelm.config import ConfigError
from servelm.kernels import quant

logger = logging.getLogger(__name__)

_TARGET = {"int8": "q8_0", **{fmt: fmt for fmt in quant.QUANTIZE_FORMATS}}


@dataclass(frozen=True)
class QuantPolicy:
    """What the loader does with each weight under one `--quantization` mode."""

    mode: str
    # GGUF types (kernel format names) kept as blocks straight from the file.
    keep_formats: frozenset[str]
    # Format every other 2-D weight is quantised to at load; None: it stays fp32.
    target: str | None = None
    # GGUF types a tied embedding keeps as blocks for its lookup alone, its LM head computing in fp32 (`none`).
    lookup_formats: frozenset[str] = frozenset()

    def apply(self, weights: Iterator[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        """Quantise the 2-D fp32/bf16 tensors of `weights` to `target` (the rest passes through)."""
        for name, tensor in weights:
            if self.target is not None and isinstance(tensor, torch.Tensor) and tensor.dim() == 2:
                tensor = quant.quantize(tensor, self.target)
            yield name, tensor

    @property
    def quantized(self) -> bool:
        return bool(self.keep_formats) or self.target is not None


NONE = QuantPolicy("none", frozenset())
# `none` where the lookup can read blocks: fp32 compute on the CPU (the blocks dequantise to fp32).
NONE_LOOKUP_BLOCKS = QuantPolicy("none", frozenset(), lookup_formats=frozenset(quant.FORMATS))


def resolve_quantization(mode: str, source_format: str, dtype: torch.dtype, device: torch.device) -> QuantPolicy:
    """The policy of `--quantization mode` for a model of `source_format` ("gguf" or "hf")."""
    supported = device.type == "cpu" and dtype == torch.float32
    if mode == "none":
        return NONE_LOOKUP_BLOCKS if supported and source_format == "gguf" else NONE
    if mode == "auto":
        if source_format != "gguf":
            return QuantPolicy("auto", frozenset())
        if not supported:
            logger.info("--quantization auto: the GGUF's weights are dequantised to %s on %s (the quantised "
                        "kernels run float32 compute on the CPU)", str(dtype).removeprefix("torch."), device.type)
            return QuantPolicy("auto", frozenset())
        return QuantPolicy("auto", frozenset(quant.FORMATS))
    if not supported:
        raise ConfigError(f"--quantization {mode} needs float32 compute on the CPU (got dtype "
                          f"{str(dtype).removeprefix('torch.')} on {device.type}); use --quantization none")
    target = _TARGET[mode]
    return QuantPolicy(mode, frozenset({target}), target)
