"""The OpenAI Images API bodies (pydantic) and their checks.

Types are checked by pydantic (a 400 naming the field, through http_common's handlers); ranges that depend
on the server's options (size, steps) by `check_size` and `check_steps`.
"""

from __future__ import annotations

import re
import time
from typing import Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_core import PydanticCustomError

from servelm.entrypoints.http_common import bad
from servelm.entrypoints.openai_protocol import _TopRequest

MAX_PROMPT_CHARS = 4000
MAX_IMAGES = 10
_SIZE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


class _ImageFields(_TopRequest):
    """Fields shared by generations and edits: OpenAI's, then servelm's extensions."""

    prompt: str
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_IMAGES)
    size: str | None = None
    user: str | None = None
    # Extensions (as SGLang's): None means the pipeline's own default.
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, ge=0.0, le=100.0)
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: str) -> str:
        if not value.strip():
            raise PydanticCustomError("empty_prompt", "must not be empty")
        if len(value) > MAX_PROMPT_CHARS:
            raise PydanticCustomError("prompt_too_long", "must be at most {limit} characters, got {length}",
                                      {"limit": MAX_PROMPT_CHARS, "length": len(value)})
        return value


class ImageGenerationRequest(_ImageFields):
    """POST /v1/images/generations. `url` results are not kept here (as SGLang): b64_json only."""

    response_format: Literal["b64_json"] | None = None

    @field_validator("response_format", mode="before")
    @classmethod
    def _format(cls, value: object) -> object:
        if value == "url":
            raise PydanticCustomError("unsupported_format",
                                      "'url' is not supported by /v1/images/generations; use 'b64_json'")
        return value


class ImageEditRequest(_ImageFields):
    """The non-file fields of POST /v1/images/edits (multipart); `url` results are served from the store."""

    response_format: Literal["b64_json", "url"] | None = None
    strength: float = Field(0.8, gt=0.0, le=1.0)  # extension: how much of the image is re-noised


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    created: int = Field(default_factory=lambda: int(time.time()))
    data: list[ImageData]


def parse_size(size: str | None, default: tuple[int, int], max_side: int) -> tuple[int, int]:
    """(width, height) of a "WxH" size, or `default`; a 400 unless both are multiples of 8 in [8, max_side]."""
    if size is None or size == "auto":
        return default
    match = _SIZE.match(size)
    if not match:
        raise bad(f"size: expected 'WIDTHxHEIGHT' (e.g. '512x512'), got {size!r}", param="size")
    width, height = int(match.group(1)), int(match.group(2))
    for side in (width, height):
        if side % 8 or not 8 <= side <= max_side:
            raise bad(f"size: width and height must be multiples of 8 in [8, {max_side}], got {size!r}",
                      param="size")
    return width, height


def check_steps(steps: int, max_steps: int) -> int:
    if steps > max_steps:
        raise bad(f"num_inference_steps: must be at most {max_steps}, got {steps}", param="num_inference_steps")
    return steps
