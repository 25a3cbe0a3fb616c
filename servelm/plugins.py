"""Formats that plugins add by entry point (reasoning formats, tool-call parsers): the built-ins, then each
installed plugin's, a broken or mistyped plugin logged and skipped rather than taking the server down."""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


def with_plugins(group: str, builtin: Mapping[str, T], convert: Callable[[Any], T | None], what: str) -> dict[str, T]:
    """`builtin` plus the entry points of `group` (a plugin's name may not shadow a built-in); `convert` turns
    what an entry point loads into a value, or None when it is not one (`what` names the expected kind)."""
    out = dict(builtin)
    for ep in importlib.metadata.entry_points(group=group):
        if ep.name in out:
            logger.warning("%s plugin %s (%s) ignored: the name is built in", what, ep.name, ep.value)
            continue
        try:
            value = convert(ep.load())
        except Exception as exc:  # a broken plugin must not take the server down
            logger.warning("%s plugin %s (%s) could not be loaded: %s", what, ep.name, ep.value, exc)
            continue
        if value is None:
            logger.warning("%s plugin %s (%s) is not one", what, ep.name, ep.value)
            continue
        out[ep.name] = value
    return out
