"""Shared pieces of the offline benchmarks: argument parsing, random prompts, the transformers baseline."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from servelm.config import ServerArgs


def build_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    group = parser.add_argument_group("benchmark")
    group.add_argument("--runs", type=int, default=3, help="Repetitions; medians are reported (default: 3).")
    group.add_argument("--baseline", choices=["none", "hf"], default="none",
                       help="Also time transformers' generate on the same model in the same run.")
    group.add_argument("--seed", type=int, default=0, help="Seed of the random prompts.")
    group.add_argument("--json", default=None, help="Append the results as one JSON line to this file.")
    ServerArgs.add_cli_args(parser)
    return parser


def random_prompts(n: int, input_len: int, vocab_size: int, seed: int, range_ratio: float = 1.0) -> list[list[int]]:
    """n prompts of random token ids (no shared prefixes), lengths in [input_len*range_ratio, input_len]."""
    gen = torch.Generator().manual_seed(seed)
    lo = max(1, int(input_len * range_ratio))
    lens = torch.randint(lo, input_len + 1, (n,), generator=gen).tolist()
    # Skip the lowest ids, which are special tokens in most vocabularies.
    return [torch.randint(100, vocab_size, (k,), generator=gen).tolist() for k in lens]


def median_of(runs: int, fn: Callable[[], dict[str, float]]) -> dict[str, float]:
    results = [fn() for _ in range(runs)]
    return {k: statistics.median(r[k] for r in results) for k in results[0]}


def load_hf_baseline(model_path: str | None, device: Any = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    """transformers' own model class with the same weights (a GGUF dequantised by our loader), on `device` in
    `dtype`; the reference of the benchmarks and of the default-model tests."""
    import transformers

    from servelm.model_loader.default_model import model_path_or_default
    from servelm.model_loader.source import load_model_source

    source = load_model_source(model_path_or_default(model_path))
    model_cls = getattr(transformers, source.config.architectures[0])
    with torch.device(device):  # built where it runs: random initialisation of a 1B model on a CPU takes a while
        model = model_cls(source.config).to(dtype).eval()
    missing, unexpected = model.load_state_dict(dict(source.iter_weights(torch.float32)), strict=False)
    # A tied checkpoint has no lm_head.weight; anything else missing or left over is a mapping bug.
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise ValueError(f"checkpoint does not fit {model_cls.__name__}: missing {missing}, unexpected {unexpected}")
    if getattr(source.config, "tie_word_embeddings", False):
        model.tie_weights()
    return model


class _TokenClock:
    """A `generate` streamer that only notes when each step's tokens come out (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.inference_mode()
def hf_generate_seconds(model: Any, prompts: list[list[int]], max_new_tokens: int,
                        clock: _TokenClock | None = None) -> float:
    """Wall time of one batched greedy `generate` (left-padded), forced to produce max_new_tokens each;
    `clock` (hf_prefill_and_decode) notes when each token comes out."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    t0 = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                   min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, streamer=clock)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return time.perf_counter() - t0


def hf_prefill_and_decode(model: Any, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, float]:
    """(seconds to the first token, seconds from the first to the last token) of one `generate`: both from the
    same run, never a difference of two runs (which a busy machine can make negative)."""
    clock = _TokenClock()
    t0 = time.perf_counter()
    total = hf_generate_seconds(model, prompts, max_new_tokens, clock)
    first = clock.times[1] - t0 if len(clock.times) > 1 else total
    return first, max(total - first, 1e-9)


def memory_bandwidth_gbs(nbytes: int = 1 << 30, device: Any = "cpu") -> float:
    """Read bandwidth of this machine's (or `device`'s) memory now: the median of summing a large fp32 tensor."""
    x = torch.ones(nbytes // 4, device=device)
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        x.sum()
        sync()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9
