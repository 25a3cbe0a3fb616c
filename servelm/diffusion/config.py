"""`DiffusionServerArgs`: the diffusion server's options, their defaults and their argparse (torch-free)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from servelm.cli.serve_backends import StrictArgumentParser
from servelm.dataclass_flags import ConfigError, add_flags, opt, values_of

PROG = "servelm serve --model-type diffusion"
DTYPES = ["auto", "float32", "bfloat16", "float16"]
LOG_LEVELS = ["debug", "info", "warning", "error"]


@dataclass(frozen=True)
class DiffusionServerArgs:
    """Every option of the diffusion server; `add_cli_args` makes one flag per field."""

    model_path: str = field(metadata={"help": "A local diffusers folder (with model_index.json).",
                                      "aliases": ("--model",)})
    host: str = opt("127.0.0.1", "Host to bind.")
    port: int = opt(30000, "Port to bind.")
    api_key: str | None = opt(None, "Require this bearer token on every API request.")
    served_model_name: str | None = opt(None, "Model name reported by the API (defaults to the model path).")
    device: str = opt("auto", "auto (cuda when available, else cpu), cpu, cuda or cuda:N.")
    dtype: str = opt("auto", "auto: float32 on CPU, bfloat16 on CUDA (float16 where bf16 is unsupported).",
                     choices=DTYPES)
    max_batch_size: int = opt(4, "Most images denoised together in one batch (requests are never split).")
    max_queued_requests: int = opt(32, "Requests waiting beyond those running; more get 429 with Retry-After.")
    batch_wait_ms: float = opt(50.0, "How long an idle scheduler waits for more requests to join a batch (small "
                                     "next to a denoising call).")
    max_image_size: int = opt(2048, "Largest width or height accepted, in pixels.")
    max_inference_steps: int = opt(500, "Largest num_inference_steps accepted.")
    image_store_size: int = opt(64, "Edited images kept for GET /v1/images/{id}/content (response_format=url), "
                                    "LRU.")
    shutdown_timeout: float = opt(30.0, "On SIGTERM, seconds running requests get to finish (none on Ctrl-C).")
    log_level: str = opt("info", "Log level.", choices=LOG_LEVELS)
    num_threads: int | None = opt(None, "CPU threads of the pipeline (default: the CPUs available, fewer while "
                                        "other processes keep them busy).")

    def __post_init__(self) -> None:
        checks = [
            (1 <= self.port <= 65535, f"--port must be in [1, 65535], got {self.port}"),
            (self.max_batch_size >= 1, f"--max-batch-size must be >= 1, got {self.max_batch_size}"),
            (self.max_queued_requests >= 1, f"--max-queued-requests must be >= 1, got {self.max_queued_requests}"),
            (self.batch_wait_ms >= 0, f"--batch-wait-ms must be >= 0, got {self.batch_wait_ms}"),
            (self.max_image_size >= 8, f"--max-image-size must be >= 8, got {self.max_image_size}"),
            (self.max_inference_steps >= 1, f"--max-inference-steps must be >= 1, got {self.max_inference_steps}"),
            (self.image_store_size >= 1, f"--image-store-size must be >= 1, got {self.image_store_size}"),
            (self.shutdown_timeout >= 0, f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}"),
            (self.num_threads is None or self.num_threads >= 1, f"--num-threads must be >= 1, got {self.num_threads}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_flags(parser, cls)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> DiffusionServerArgs:
        """The flags, then the `--config` file's keys for flags the command line did not give (as ServerArgs)."""
        values = values_of(ns, cls)
        if not values.get("model_path"):
            raise ConfigError("--model-path is required. Please provide the path to the model.")
        return cls(**values)


def build_parser() -> StrictArgumentParser:
    parser = StrictArgumentParser(
        prog=PROG,
        description="diffusion backend: serve a diffusers pipeline (text-to-image, image-to-image) over the "
                    "OpenAI Images API (/v1/images/generations, /v1/images/edits).",
    )
    DiffusionServerArgs.add_cli_args(parser)
    return parser
