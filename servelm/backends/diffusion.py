"""The built-in `diffusion` serve backend.

Its detector recognises diffusers model folders from their metadata alone
(`model_index.json`, the README model card) and never imports a diffusion
runtime. Serving diffusion models is not implemented yet: `run` says so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

from servelm.cli.serve import wants_help
from servelm.cli.serve_backends import (
    SERVE_BACKEND_API_VERSION,
    ServeBackend,
    ServeBackendDetection,
    ServeRequest,
)

# Hugging Face pipeline tags of generative image/video/audio/3D models.
_GENERATIVE_TAG_SUFFIXES = ("-to-image", "-to-video", "-to-audio", "-to-3d")

NOT_IMPLEMENTED = "diffusion serving is not implemented yet in servelm"

HELP = f"""\
usage: servelm serve --model-type diffusion [MODEL | --model-path MODEL]

diffusion backend: serves diffusers pipelines (text-to-image, -video, -audio, -3d).
Note: {NOT_IMPLEMENTED}; selecting it exits with an error.
It is picked by --model-type auto for a local folder whose model_index.json has
_diffusers_version, or whose README.md model card says `library_name: diffusers`
or has a pipeline_tag ending in -to-image/-to-video/-to-audio/-to-3d.
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


def run(request: ServeRequest) -> None:
    """Print help, or say that diffusion serving is not implemented and exit 1."""
    if wants_help(request.argv):
        print(HELP, end="")
        return
    print(f"Error: {NOT_IMPLEMENTED} (model: {request.model_path}).", file=sys.stderr)
    raise SystemExit(1)


def create_backend() -> ServeBackend:
    """Factory of the built-in `diffusion` backend."""
    return ServeBackend(api_version=SERVE_BACKEND_API_VERSION, run=run, detect=detect,
                        summary="detects diffusers folders; cannot serve them yet (not implemented)")
