"""`DiffusionServerArgs`: the diffusion server's options, their defaults and their argparse (torch-free)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from servelm.cli.serve import StrictArgumentParser
from servelm.config import ConfigError, load_config_file

PROG = "servelm serve --model-type diffusion"
DTYPES = ("auto", "float32", "bfloat16", "float16")
_HELP = {
    "model_path": "A local diffusers folder (with model_index.json).",
    "host": "Host to bind.",
    "port": "Port to bind.",
    "api_key": "Require this bearer token on every API request.",
    "served_model_name": "Model name reported by the API (defaults to the model path).",
    "device": "auto (cuda when available, else cpu), cpu, cuda or cuda:N.",
    "dtype": "auto: float32 on CPU, bfloat16 on CUDA (float16 where bf16 is unsupported).",
    "max_batch_size": "Most images denoised together in one batch (requests are never split).",
    "max_queued_requests": "Requests waiting beyond those running; more get 429 with Retry-After.",
    "batch_wait_ms": "How long an idle scheduler waits for more requests to join a batch (small next to a "
                     "denoising call).",
    "max_image_size": "Largest width or height accepted, in pixels.",
    "max_inference_steps": "Largest num_inference_steps accepted.",
    "image_store_size": "Edited images kept for GET /v1/images/{id}/content (response_format=url), LRU.",
    "shutdown_timeout": "On SIGTERM, seconds running requests get to finish (none on Ctrl-C).",
    "log_level": "Log level.",
    "num_threads": "CPU threads of the pipeline (default: the CPUs available, fewer while other processes keep "
                   "them busy).",
}


@dataclass(frozen=True)
class DiffusionServerArgs:
    """Every option of the diffusion server; `add_cli_args` makes one flag per field."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    max_batch_size: int = 4
    max_queued_requests: int = 32
    batch_wait_ms: float = 50.0
    max_image_size: int = 2048
    max_inference_steps: int = 500
    image_store_size: int = 64
    shutdown_timeout: float = 30.0
    log_level: str = "info"
    num_threads: int | None = None

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
        parser.add_argument("--config", default=None, help="YAML file of arguments (CLI flags win).")
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kwargs: dict = {"help": _HELP[f.name], "dest": f.name}
            if f.name == "model_path":
                parser.add_argument(flag, "--model", default=None, **kwargs)
                continue
            kind = {"int": int, "int | None": int, "float": float}.get(str(f.type), str)
            if f.default is not None:
                kwargs["help"] += f" (default: {f.default})"
            if f.name == "dtype":
                kwargs["choices"] = DTYPES
            if f.name == "log_level":
                kwargs["choices"] = ["debug", "info", "warning", "error"]
            parser.add_argument(flag, type=kind, default=f.default, **kwargs)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> DiffusionServerArgs:
        """The flags, then the `--config` file's keys for flags left at their default (as ServerArgs)."""
        values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)}
        defaults = {f.name: (None if f.name == "model_path" else f.default) for f in dataclasses.fields(cls)}
        if ns.config:
            for key, value in load_config_file(ns.config).items():
                name = "model_path" if key == "model" else key.replace("-", "_")
                if name not in defaults:
                    raise ConfigError(f"unknown key '{key}' in config file {ns.config}")
                if values[name] == defaults[name]:
                    values[name] = value
        if not values["model_path"]:
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
