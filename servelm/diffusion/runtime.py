"""The diffusers side: load a pipeline folder, run a batch of image jobs through it, encode PNGs.

One `DiffusionRuntime` per server (or `servelm generate` / bench run); call `run` from one thread only (the
CPU thread count that the governor adapts belongs to the calling thread). `run(jobs)` denoises every image of
every job as one pipeline call: one prompt row and one `torch.Generator` per image, so that a seed gives the
same image alone and in a batch. The pipeline's step-end callback times each step and stops the call as soon
as every job of the batch is cancelled (`BatchCancelled`).
"""

from __future__ import annotations

import inspect
import io
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoPipelineForImage2Image, DiffusionPipeline
from diffusers.pipelines.auto_pipeline import AUTO_TEXT2IMAGE_PIPELINES_MAPPING
from PIL import Image

from servelm.cpu_threads import ThreadGovernor

logger = logging.getLogger("servelm.diffusion")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PipelineLoadError(RuntimeError):
    """The folder is not a diffusers pipeline servelm can load; the message is one line for the user."""


class BatchCancelled(Exception):
    """Every job of the batch was cancelled; the pipeline call stopped after `steps_done` steps."""

    def __init__(self, steps_done: int) -> None:
        super().__init__(f"cancelled after {steps_done} denoising step(s)")
        self.steps_done = steps_done


@dataclass
class ImageJob:
    """One request: `n` images of one prompt; defaults already resolved. `image` makes it an edit."""

    prompt: str
    n: int
    width: int
    height: int
    steps: int
    guidance: float | None
    seed: int
    negative_prompt: str | None = None
    image: Image.Image | None = None
    strength: float = 0.8
    cancelled: bool = False

    def batch_key(self) -> tuple:
        """Jobs with equal keys run as one pipeline call."""
        return (self.image is not None, self.width, self.height, self.steps, self.guidance,
                self.negative_prompt is not None, self.strength if self.image is not None else None)


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_pipeline(model_path: str, device: str, dtype: torch.dtype) -> DiffusionPipeline:
    """`DiffusionPipeline.from_pretrained` on a local folder (diffusers shows the load progress bar)."""
    if not (Path(model_path) / "model_index.json").is_file():
        raise PipelineLoadError(f"{model_path} is not a diffusers pipeline folder (no model_index.json)")
    try:
        pipe = DiffusionPipeline.from_pretrained(model_path, dtype=dtype, local_files_only=True)
    except Exception as exc:
        text = " ".join(str(exc).split())[:300]
        raise PipelineLoadError(f"diffusers cannot load the pipeline in {model_path}: "
                                f"{type(exc).__name__}: {text}") from exc
    params = inspect.signature(pipe.__call__).parameters
    if "prompt" not in params or "num_inference_steps" not in params:
        raise PipelineLoadError(f"{type(pipe).__name__} in {model_path} is not a text-to-image pipeline "
                                "(its call takes no prompt or num_inference_steps)")
    return pipe.to(device)


def encode_png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _default_size(pipe: Any) -> tuple[int, int]:
    """The pipeline's own default output size (its sample size times the VAE's scale), else 512x512."""
    sample = getattr(pipe, "default_sample_size", None)
    for name in ("unet", "transformer"):
        if sample is None:
            sample = getattr(getattr(getattr(pipe, name, None), "config", None), "sample_size", None)
    if isinstance(sample, (list, tuple)):
        sample = sample[0]
    side = int(sample) * int(getattr(pipe, "vae_scale_factor", 8)) if sample else 512
    side = max(8, side - side % 8)
    return side, side


def _param_default(params: dict[str, inspect.Parameter], name: str, fallback: Any) -> Any:
    param = params.get(name)
    if param is None or param.default is inspect.Parameter.empty or param.default is None:
        return fallback
    return param.default


class DiffusionRuntime:
    """A loaded pipeline, its image-to-image variant (when diffusers has one) and their defaults."""

    def __init__(self, pipe: DiffusionPipeline, model_path: str, governor: ThreadGovernor | None = None) -> None:
        self.pipe = pipe
        self.governor = governor  # fewer CPU threads while other processes keep the CPUs busy
        self.model_path = model_path
        pipe.set_progress_bar_config(disable=True)
        self.params = dict(inspect.signature(pipe.__call__).parameters)
        self.default_size = _default_size(pipe)
        self.default_steps = int(_param_default(self.params, "num_inference_steps", 50))
        guidance = _param_default(self.params, "guidance_scale", None)
        self.default_guidance = float(guidance) if "guidance_scale" in self.params and guidance is not None else None
        self.img2img = self._image_to_image(pipe)

    @classmethod
    def load(cls, model_path: str, device: str = "auto", dtype: str = "auto",
             num_threads: int | None = None) -> DiffusionRuntime:
        device = resolve_device(device)
        governor = ThreadGovernor.for_process(num_threads) if device == "cpu" else None
        return cls(load_pipeline(model_path, device, resolve_dtype(dtype, device)), model_path, governor)

    @staticmethod
    def _image_to_image(pipe: DiffusionPipeline) -> DiffusionPipeline | None:
        try:
            variant = AutoPipelineForImage2Image.from_pipe(pipe)
        except Exception as exc:  # diffusers has no image-to-image variant of this pipeline class
            logger.info("No image-to-image variant of %s (edits are refused): %s", type(pipe).__name__, exc)
            return None
        variant.set_progress_bar_config(disable=True)
        return variant

    def accepts(self, name: str) -> bool:
        return name in self.params

    @property
    def device(self) -> str:
        return str(self.pipe.device)

    @property
    def dtype(self) -> str:
        return str(self.pipe.dtype).removeprefix("torch.")

    def info(self) -> dict[str, Any]:
        task = "text-to-image" if type(self.pipe) in AUTO_TEXT2IMAGE_PIPELINES_MAPPING.values() else "image"
        return {"model_path": self.model_path, "pipeline_class": type(self.pipe).__name__, "task_type": task,
                "dtype": self.dtype, "device": self.device, "supports_edits": self.img2img is not None,
                "default_size": "{}x{}".format(*self.default_size), "default_steps": self.default_steps}

    def run(self, jobs: list[ImageJob], on_step: Callable[[float], None] | None = None) -> list[list[bytes]]:
        """Denoise every image of `jobs` (equal batch keys) in one call; PNGs per job ([] for a cancelled job).

        Raises BatchCancelled when every job is cancelled before the call ends."""
        first = jobs[0]
        pipe = self.img2img if first.image is not None else self.pipe
        assert pipe is not None, "edits need an image-to-image pipeline"
        kwargs = self._call_kwargs(jobs)
        started = [time.perf_counter(), 0]

        def step_end(_pipe: Any, step: int, _timestep: Any, _tensors: dict[str, Any]) -> dict[str, Any]:
            if self.governor is not None:
                self.governor.tick()
            now = time.perf_counter()
            if on_step is not None:
                on_step(now - started[0])
            started[0], started[1] = now, step + 1
            if all(job.cancelled for job in jobs):
                raise BatchCancelled(step + 1)
            return {}

        if "callback_on_step_end" in inspect.signature(pipe.__call__).parameters:
            kwargs["callback_on_step_end"] = step_end
        with torch.inference_mode():
            images = pipe(**kwargs).images
        out, i = [], 0
        for job in jobs:
            out.append([] if job.cancelled else [encode_png(img) for img in images[i:i + job.n]])
            i += job.n
        return out

    def _call_kwargs(self, jobs: list[ImageJob]) -> dict[str, Any]:
        first = jobs[0]
        rows = [(job, k) for job in jobs for k in range(job.n)]
        kwargs: dict[str, Any] = {
            "prompt": [job.prompt for job, _ in rows],
            "num_inference_steps": first.steps,
            "generator": [torch.Generator("cpu").manual_seed(job.seed + k) for job, k in rows],
            "output_type": "pil",
        }
        if first.guidance is not None:
            kwargs["guidance_scale"] = first.guidance
        if first.negative_prompt is not None:
            kwargs["negative_prompt"] = [job.negative_prompt for job, _ in rows]
        if first.image is not None:
            kwargs["image"] = [job.image for job, _ in rows]
            kwargs["strength"] = first.strength
        else:
            kwargs["height"], kwargs["width"] = first.height, first.width
        return kwargs
