"""The built-in `diffusion` serve backend.

Its detector recognises diffusers model folders from their metadata alone
(`model_index.json`, the README model card) and never imports a diffusion
runtime. `run` serves the folder with the OpenAI Images API (`servelm.diffusion`,
imported only then); `generate` is `servelm generate` for a diffusers folder.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import yaml

from servelm.cli.serve_backends import (
    SERVE_BACKEND_API_VERSION,
    CliError,
    ServeBackend,
    ServeBackendDetection,
    ServeRequest,
    wants_help,
)

logger = logging.getLogger(__name__)

# Hugging Face pipeline tags of generative image/video/audio/3D models.
_GENERATIVE_TAG_SUFFIXES = ("-to-image", "-to-video", "-to-audio", "-to-3d")

INSTALL_HINT = "pip install 'servelm[diffusion]'"

DETECTION_HELP = """\
It is picked by --model-type auto for a local folder whose model_index.json has
_diffusers_version, or whose README.md model card says `library_name: diffusers`
or has a pipeline_tag ending in -to-image/-to-video/-to-audio/-to-3d.
API: POST /v1/images/generations, POST /v1/images/edits, GET /v1/images/{id}/content,
GET /v1/models, GET /models, /health, /metrics.
"""


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _model_card(readme: Path) -> dict[str, Any]:
    """The YAML front matter of a model card README ({} when absent or malformed)."""
    try:
        text = readme.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    lines = text.lstrip("\ufeff").splitlines()
    if not lines or lines[0].strip() != "---":
        return {}
    try:
        end = next(i for i in range(1, len(lines)) if lines[i].strip() == "---")
    except StopIteration:
        return {}
    try:
        data = yaml.safe_load("\n".join(lines[1:end]))
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def detect(request: ServeRequest) -> ServeBackendDetection:
    """MATCH for a local diffusers model folder, NO_MATCH otherwise, UNKNOWN without a path."""
    if not request.model_path:
        return ServeBackendDetection.UNKNOWN
    folder = Path(request.model_path)
    if not folder.is_dir():
        return ServeBackendDetection.NO_MATCH
    index = _read_json(folder / "model_index.json")
    if isinstance(index, dict) and "_diffusers_version" in index:
        return ServeBackendDetection.MATCH
    card = _model_card(folder / "README.md")
    library = card.get("library_name")
    tag = card.get("pipeline_tag")
    if isinstance(library, str) and library.strip().lower() == "diffusers":
        return ServeBackendDetection.MATCH
    if isinstance(tag, str) and tag.strip().lower().endswith(_GENERATIVE_TAG_SUFFIXES):
        return ServeBackendDetection.MATCH
    return ServeBackendDetection.NO_MATCH


def require_diffusers() -> None:
    """One line on how to install the runtime when diffusers is missing (checked without importing it)."""
    missing = [m for m in ("diffusers", "PIL", "multipart") if importlib.util.find_spec(m) is None]
    if missing:
        raise CliError(f"The diffusion backend needs diffusers, Pillow and python-multipart "
                       f"(missing: {', '.join(missing)}): {INSTALL_HINT}")


def check_pipeline_folder(model_path: str) -> None:
    """A one-line error, before anything starts, for a path that cannot be a diffusers pipeline."""
    folder = Path(model_path)
    if not folder.is_dir():
        raise CliError(f"{model_path} is not a local folder: the diffusion backend serves a diffusers folder "
                       "(with model_index.json)")
    index = _read_json(folder / "model_index.json")
    if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
        raise CliError(f"{model_path} is not a diffusers pipeline folder: no model_index.json naming its "
                       "pipeline class (_class_name)")


def configure_threads(num_threads: int | None) -> None:
    """The CPU thread count, set before torch loads (as the llm backend does for its processes)."""
    from servelm.cpu_threads import configure_cpu_threads, describe_threads

    logger.info("The pipeline uses %s", describe_threads(configure_cpu_threads(num_threads)))


def run(request: ServeRequest) -> None:
    """Print help, or serve the diffusers folder over the OpenAI Images API until stopped."""
    from servelm.diffusion.config import DiffusionServerArgs, build_parser

    parser = build_parser()
    if wants_help(request.argv):
        parser.print_help()
        print("\n" + DETECTION_HELP, end="")
        return
    args = DiffusionServerArgs.from_namespace(parser.parse_args(list(request.argv)))
    check_pipeline_folder(args.model_path)
    require_diffusers()
    configure_threads(args.num_threads)
    # Imported here so that help, detection and the llm path never pull in torch or diffusers.
    from servelm.diffusion.server import ServerError, launch_server

    try:
        launch_server(args)
    except ServerError as exc:  # written for the user: no type name in the Error line
        raise CliError(str(exc), original=exc) from None


def generate(argv: list[str]) -> int:
    """`servelm generate` for a diffusers folder: write PNGs, print their paths."""
    from servelm.diffusion.generate import build_parser, generate_images

    ns = build_parser().parse_args(argv)
    check_pipeline_folder(ns.model_path)
    require_diffusers()
    configure_threads(ns.num_threads)
    return generate_images(ns)


def create_backend() -> ServeBackend:
    """Factory of the built-in `diffusion` backend."""
    return ServeBackend(api_version=SERVE_BACKEND_API_VERSION, run=run, detect=detect,
                        summary="diffusers pipelines (text-to-image, image-to-image) over the OpenAI Images API")
