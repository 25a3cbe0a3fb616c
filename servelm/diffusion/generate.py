"""`servelm generate` for a diffusers folder: one-shot images, written as PNG files (paths on stdout)."""

from __future__ import annotations

import argparse
import random
import re
import time
from pathlib import Path

from servelm.cli.serve_backends import CliError, StrictArgumentParser
from servelm.diffusion.config import DTYPES
from servelm.diffusion.protocol import MAX_IMAGES, parse_size
from servelm.entrypoints.http_common import ApiError

MAX_SIDE = 8192


def build_parser() -> StrictArgumentParser:
    parser = StrictArgumentParser(
        prog="servelm generate",
        description="Generate images offline with a diffusers pipeline folder; with --save-output, write them "
                    "as PNG files and print their paths.",
    )
    parser.add_argument("--model-path", "--model", required=True, help="A local diffusers folder.")
    parser.add_argument("--prompt", required=True, help="What to draw.")
    parser.add_argument("--negative-prompt", default=None, help="What not to draw.")
    parser.add_argument("--seed", type=int, default=None, help="Seed of the first image (image i: seed + i).")
    parser.add_argument("--steps", type=int, default=None, help="Denoising steps (default: the pipeline's).")
    parser.add_argument("--guidance-scale", type=float, default=None, help="Guidance (default: the pipeline's).")
    parser.add_argument("--size", default=None, help="WIDTHxHEIGHT, multiples of 8 (default: the pipeline's).")
    parser.add_argument("--n", type=int, default=1, help=f"Number of images, 1..{MAX_IMAGES} (default: 1).")
    parser.add_argument("--save-output", action="store_true", help="Write the images as PNG files.")
    parser.add_argument("--output-dir", default="outputs", help="Where to write them (default: ./outputs).")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N.")
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: float32 on CPU, bf16/fp16 on CUDA.")
    parser.add_argument("--num-threads", type=int, default=None, help="CPU threads (default: the CPUs available).")
    return parser


def _checked(ns: argparse.Namespace) -> None:
    if not ns.prompt.strip():
        raise CliError("--prompt must not be empty")
    if not 1 <= ns.n <= MAX_IMAGES:
        raise CliError(f"--n must be in [1, {MAX_IMAGES}], got {ns.n}")
    if ns.steps is not None and ns.steps < 1:
        raise CliError(f"--steps must be >= 1, got {ns.steps}")
    if ns.num_threads is not None and ns.num_threads < 1:
        raise CliError(f"--num-threads must be >= 1, got {ns.num_threads}")
    if ns.seed is not None and ns.seed < 0:
        raise CliError(f"--seed must be >= 0, got {ns.seed}")


def file_stem(prompt: str, seed: int, index: int) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:40] or "image"
    return f"{slug}-seed{seed}-{index}"


def _size(size: str | None) -> tuple[int, int] | None:
    try:
        return None if size is None else parse_size(size, (0, 0), MAX_SIDE)
    except ApiError as exc:
        raise CliError(f"--{exc.message}") from None


def generate_images(ns: argparse.Namespace) -> int:
    _checked(ns)
    size = _size(ns.size)  # before the load: a typo costs nothing
    from servelm.diffusion.runtime import DiffusionRuntime, ImageJob, PipelineLoadError

    try:
        runtime = DiffusionRuntime.load(ns.model_path, ns.device, ns.dtype, ns.num_threads)
    except PipelineLoadError as exc:
        raise CliError(str(exc)) from None
    width, height = size or runtime.default_size
    seed = ns.seed if ns.seed is not None else random.randrange(2**31)
    guidance = ns.guidance_scale if ns.guidance_scale is not None else runtime.default_guidance
    job = ImageJob(prompt=ns.prompt, n=ns.n, width=width, height=height, steps=ns.steps or runtime.default_steps,
                   guidance=guidance, seed=seed, negative_prompt=ns.negative_prompt)
    started = time.perf_counter()
    pngs = runtime.run([job])[0]
    seconds = time.perf_counter() - started
    if not ns.save_output:
        print(f"Generated {len(pngs)} image(s) of {width}x{height} in {seconds:.1f} s (seed {seed}); "
              "pass --save-output to write them", flush=True)
        return 0
    out_dir = Path(ns.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for i, png in enumerate(pngs):
        path = out_dir / f"{file_stem(ns.prompt, seed, i)}.png"
        path.write_bytes(png)
        print(path, flush=True)
    return 0
