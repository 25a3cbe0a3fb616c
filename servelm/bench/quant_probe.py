"""Quantised-weight matmul probe (issue 13): time per call of each candidate on this CPU.

For the default model's linear shapes and a range of batch rows M, times fp32 oneDNN with a pre-packed
weight (servelm's fp32 path), torch's weight-only int8 (`_weight_int8pack_mm`) and int4
(`_weight_int4pack_mm_for_cpu`, groups of 32) where this torch has them, and servelm's own kernel
(`servelm.kernels.quant.linear`) per ggml format. Medians in microseconds; prints a markdown table.

    servelm bench quant [--m 1,4,16,64,256] [--formats q8_0,q4_0,q4_1] [--isa avx2]
        [--threads 1 --clock thread] [--model-pass]

Cells: median us per call (speed-up over fp32 oneDNN); "-": not timed (see --torch-max-m).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch

from servelm.kernels import quant
from servelm.layers.linear import packed_linear, prepack_weight

# (name, N out, K in) of SmolLM2-135M: q/o, k/v, gate/up, down, the LM head.
DEFAULT_SHAPES = [("q_proj/o_proj", 576, 576), ("k_proj/v_proj", 192, 576), ("gate/up", 1536, 576),
                  ("down_proj", 576, 1536), ("lm_head", 49152, 576)]


def time_us(fn: Callable[[torch.Tensor], object], x: torch.Tensor, clock: Callable[[], float] = time.perf_counter,
            min_s: float = 0.3, max_reps: int = 100) -> float:
    """Median microseconds of `fn(x)` (after one warm-up call), at least 5 and at most `max_reps` calls."""
    fn(x)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or (len(times) < max_reps and time.perf_counter() - start < min_s):
        t0 = clock()
        fn(x)
        times.append(clock() - t0)
    return statistics.median(times) * 1e6


def torch_int8(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    op = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
    if op is None:
        return None
    scales = w.abs().amax(dim=1).clamp_min(1e-8) / 127
    q = torch.round(w / scales[:, None]).to(torch.int8)
    return lambda x: op(x, q, scales)


def torch_int4(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    op = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
    if op is None or w.shape[1] % 32:
        return None
    n, k = w.shape
    g = w.reshape(n, k // 32, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    # torch's int4 zero point is the value of code 8: w = (q - 8) * scale + zero
    zeros = lo + 8 * scale
    scale_zeros = torch.stack([scale.T, zeros.T], dim=-1).contiguous()
    return lambda x: op(x, packed, 32, scale_zeros)


def candidates(w: torch.Tensor, formats: list[str]) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    packed = prepack_weight(w)
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"fp32 oneDNN": lambda x: packed_linear(x, packed, None)}
    for name, make in (("torch int8", torch_int8), ("torch int4", torch_int4)):
        fn = make(w)
        if fn is not None:
            out[name] = fn
    for fmt in formats:
        qw = quant.quantize(w, fmt)
        out[f"ours {fmt}"] = lambda x, qw=qw: quant.linear(x, qw)
        # deterministic mode's path: the int16 scheme at every M (the default switches to fp32 tiles at 10 rows)
        out[f"ours {fmt} int16"] = lambda x, qw=qw: quant.linear(x, qw, invariant=True)
    return out


def default_model_weights() -> list[tuple[str, quant.QuantWeight]]:
    """Every 2-D weight of the default model's GGUF, as its own blocks (Q4_1 linears, the Q8_0 embedding
    that is also the tied LM head), in file order; the embedding goes last, as the LM head runs last."""
    from gguf import GGUFReader

    from servelm.model_loader.default_model import default_model_path

    out = []
    for t in GGUFReader(default_model_path()).tensors:
        fmt = t.tensor_type.name.lower()
        if fmt in quant.FORMATS and len(t.shape) == 2:
            out.append((t.name, quant.from_gguf(t.data, fmt, (int(t.shape[1]), int(t.shape[0])))))
    return sorted(out, key=lambda item: item[0] == "token_embd.weight")


def model_pass(ms: list[int], formats: list[str], clock: Callable[[], float]) -> None:
    """One matmul per weight of the default model (all layers, then the LM head) on random rows: how long a
    forward's linears take with fp32 oneDNN vs the file's own blocks vs re-quantised ones. Weights stream
    from memory here (~0.5 GB in fp32), as in a real forward, unlike the per-shape table."""
    named = default_model_weights()
    fp32 = [quant.dequantize(qw) for _, qw in named]
    variants: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {}
    packed = [prepack_weight(w) for w in fp32]
    variants["fp32 oneDNN"] = [lambda x, p=p: packed_linear(x, p, None) for p in packed]
    sizes = {"fp32 oneDNN": sum(w.numel() * 4 for w in fp32)}
    file_q = [qw for _, qw in named]
    variants["ours, GGUF blocks"] = [lambda x, qw=qw: quant.linear(x, qw) for qw in file_q]
    sizes["ours, GGUF blocks"] = sum(qw.nbytes for qw in file_q)
    for fmt in formats:
        qws = [quant.quantize(w, fmt) for w in fp32]
        variants[f"ours {fmt}"] = [lambda x, qw=qw: quant.linear(x, qw) for qw in qws]
        sizes[f"ours {fmt}"] = sum(qw.nbytes for qw in qws)
    del fp32
    print(f"\nDefault model, one pass over its {len(named)} weight matrices (ms; resident weight MB in the header)")
    print("| M | " + " | ".join(f"{k} ({sizes[k] / 1e6:.0f} MB)" for k in variants) + " |")
    print("|" + "---|" * (len(variants) + 1))
    for m in ms:
        xs = {k: torch.randn(m, k) for k in {qw.shape[1] for _, qw in named}}
        inputs = [xs[qw.shape[1]] for _, qw in named]
        cells = []
        for fns in variants.values():
            def one_pass(_: torch.Tensor, fns=fns, inputs=inputs) -> None:
                for fn, x in zip(fns, inputs):
                    fn(x)
            cells.append(time_us(one_pass, inputs[0], clock, min_s=1.0, max_reps=10) / 1e3)
        base = cells[0]
        print(f"| {m} | {base:.1f} | " + " | ".join(f"{c:.1f} ({base / c:.2f}x)" for c in cells[1:]) + " |",
              flush=True)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="servelm bench quant", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", default="1,4,16,64,256", help="Rows of x (batch tokens), comma-separated.")
    parser.add_argument("--formats", default=",".join(quant.QUANTIZE_FORMATS))
    parser.add_argument("--isa", default=None, help="Force the kernel path (scalar, avx2, avx512, avx512_vnni, torch).")
    parser.add_argument("--shapes", default=None, help="Only these shape names (comma-separated).")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own).")
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall",
                        help="thread: CPU time of this thread (with --threads 1; steadier on a shared machine).")
    parser.add_argument("--model-pass", action="store_true",
                        help="Instead: one pass over all of the default model's weights per M (decode-like).")
    parser.add_argument("--torch-max-m", type=int, default=16,
                        help="Time torch's int8/int4 ops only up to this M (they take seconds beyond).")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.isa:
        quant.force_backend(args.isa)
    ms = [int(v) for v in args.m.split(",")]
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    shapes = [s for s in DEFAULT_SHAPES if not args.shapes or s[0] in args.shapes.split(",")]
    if args.clock == "thread" and torch.get_num_threads() != 1:
        parser.error("--clock thread needs --threads 1 (other threads' time would not count)")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    torch.manual_seed(0)
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"kernel path: {quant.kernel_backend()}; median us per call ({args.clock} clock)")
    if args.model_pass:
        model_pass(ms, formats, clock)
        return 0
    header = None
    for name, n, k in shapes:
        fns = candidates(torch.randn(n, k) * 0.05, formats)
        if header is None:
            header = ["shape", "M", *fns]
            print("| " + " | ".join(header) + " |")
            print("|" + "---|" * len(header))
        for m in ms:
            x = torch.randn(m, k)
            base = time_us(fns["fp32 oneDNN"], x, clock)
            cells = [f"{base:.0f}"]
            for label, fn in fns.items():
                if label.startswith("torch") and m > args.torch_max_m:
                    cells.append("-")
                elif label != "fp32 oneDNN":
                    t = time_us(fn, x, clock)
                    cells.append(f"{t:.0f} ({base / t:.2f}x)")
            print(f"| {name} {n}x{k} | {m} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
