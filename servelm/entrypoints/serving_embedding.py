"""POST /v1/embeddings (OpenAI's API, with vLLM's `truncate_prompt_tokens` and `add_special_tokens`).

`input` is a string, a list of strings, a list of token ids or a list of such lists; each input is one
sub-request of the embedding scheduler, which batches inputs of every request by its token budget. Vectors
come back from the scheduler as float32 bytes in base64, which is `encoding_format: "base64"` as it is, and
decoded for `"float"`. `dimensions` keeps the first N (Matryoshka) and normalises again.
"""

from __future__ import annotations

import array
import base64
import json
import math
import sys
import time
import uuid
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from servelm.entrypoints.http_common import bad
from servelm.entrypoints.openai_protocol import _Response, _TopRequest
from servelm.entrypoints.serving_base import OpenAIServing
from servelm.sampling_params import SamplingParams, input_length_error

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request


class EmbeddingRequest(_TopRequest):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extensions
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    add_special_tokens: bool = True


class PoolingRequest(EmbeddingRequest):
    """vLLM's POST /pooling: the model's pooled output as it is (an embedding model's vector, a
    cross-encoder's logits), no `dimensions`."""

    dimensions: None = None


class PoolingData(_Response):
    object: Literal["pooling"] = "pooling"
    index: int
    data: list[float] | str


class EmbeddingData(_Response):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Response):
    id: str
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def decode_vector(b64: str) -> array.array:
    """A vector the scheduler sent (float32 little-endian in base64)."""
    vec = array.array("f")
    vec.frombytes(base64.b64decode(b64))
    if sys.byteorder != "little":
        vec.byteswap()
    return vec


def shorten(vec: array.array, dimensions: int, normalize: bool) -> array.array:
    """The first `dimensions` values (Matryoshka), made unit length again when the model normalises."""
    out = vec[:dimensions]
    if normalize:
        norm = math.sqrt(math.fsum(x * x for x in out))
        if norm > 0:
            out = array.array("f", (x / norm for x in out))
    return out


def encode_vector(vec: array.array) -> str:
    raw = array.array("f", vec)
    if sys.byteorder != "little":
        raw.byteswap()
    return base64.b64encode(raw.tobytes()).decode()


class ServingEmbedding(OpenAIServing):
    """POST /v1/embeddings."""

    def inputs(self, req: EmbeddingRequest) -> list[list[int]]:
        """Every input's token ids, each checked against the vocabulary and the model's input limit (cut to
        `truncate_prompt_tokens` first: the tokenizer's side for text, the end for token ids)."""
        raw = req.input
        if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw)):
            items: list[Any] = [raw]
        else:
            items = list(raw)
        if not items:
            raise bad("input must not be empty", "input")
        if len(items) > MAX_INPUTS:
            raise bad(f"input has {len(items)} items; at most {MAX_INPUTS} per request", "input")
        limit = self.manager.context_length
        keep = req.truncate_prompt_tokens
        if keep == -1:
            keep = limit
        if keep is not None and keep > limit:
            raise bad(f"truncate_prompt_tokens ({keep}) is more than the model's context length ({limit} tokens)",
                      "truncate_prompt_tokens")
        tokenizer = self.manager.tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        backend = backend if backend is not None and backend.truncation is None else None
        out = []
        for i, item in enumerate(items):
            where = "input" if len(items) == 1 else f"input.{i}"
            if isinstance(item, str):
                if keep is not None:
                    ids = tokenizer(item, add_special_tokens=req.add_special_tokens, truncation=True,
                                    max_length=keep)["input_ids"]
                elif backend is not None:  # the Rust tokenizer itself: half the time of the HF call
                    ids = backend.encode(item, add_special_tokens=req.add_special_tokens).ids
                else:
                    ids = tokenizer(item, add_special_tokens=req.add_special_tokens)["input_ids"]
            else:
                ids = list(item)
                if keep is not None:
                    ids = ids[:keep]
                self.check_ids(ids, where)
            if not ids:
                raise bad(f"{where} has no tokens to embed (an empty string with add_special_tokens false)", where)
            error = input_length_error(len(ids), limit, where)
            if error:
                raise bad(error, where)
            out.append(ids)
        return out

    async def pooling(self, req: PoolingRequest, request: Request) -> Any:
        """vLLM's POST /pooling on an embedding model or a cross-encoder (each input alone)."""
        self.check_model(req.model, task="score" if self.manager.model_info.get("task") == "score" else "embed")
        inputs = self.inputs(req)
        rid = f"pool-{uuid.uuid4().hex}"
        group = self.submit(inputs, SamplingParams(max_new_tokens=0), rid, False)
        result = await self.run_or_stream(group, request, None)
        if not isinstance(result, list):
            return result  # the client hung up
        data = []
        for index, acc in enumerate(result):
            if acc.embedding is None:
                raise bad(f"input.{index} was not pooled", "input")
            vector = acc.embedding if req.encoding_format == "base64" else decode_vector(acc.embedding).tolist()
            data.append(PoolingData(index=index, data=vector).model_dump())
        tokens = sum(len(ids) for ids in inputs)
        body = {"id": rid, "object": "list", "created": int(time.time()), "model": self.state.model_name,
                "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}
        return Response(content=json.dumps(body), media_type="application/json")

    async def create(self, req: EmbeddingRequest, request: Request) -> Any:
        self.check_model(req.model, task="embed")
        info = self.manager.model_info
        width = int(info.get("embedding_dimensions") or 0)
        if req.dimensions is not None and not 1 <= req.dimensions <= width:
            raise bad(f"dimensions must be between 1 and the model's {width} dimensions, got {req.dimensions}",
                      "dimensions")
        inputs = self.inputs(req)
        rid = f"embd-{uuid.uuid4().hex}"
        group = self.submit(inputs, SamplingParams(max_new_tokens=0), rid, False)
        result = await self.run_or_stream(group, request, None)
        if not isinstance(result, list):
            return result  # the client hung up
        data = []
        normalize = bool(info.get("normalize"))
        for index, acc in enumerate(result):
            if acc.embedding is None:
                raise bad(f"input.{index} was not embedded", "input")  # an abort is raised before this
            if req.dimensions is None and req.encoding_format == "base64":
                vector: list[float] | str = acc.embedding
            else:
                vec = decode_vector(acc.embedding)
                if req.dimensions is not None:
                    vec = shorten(vec, req.dimensions, normalize)
                vector = encode_vector(vec) if req.encoding_format == "base64" else vec.tolist()
            data.append(EmbeddingData(index=index, embedding=vector))
        tokens = sum(len(ids) for ids in inputs)
        body = EmbeddingResponse(id=rid, data=data, model=self.state.model_name,
                                 usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
        # Serialised by pydantic's own JSON encoder: FastAPI's path (jsonable_encoder, then json.dumps) walks
        # every float of every vector in Python.
        return Response(content=body.model_dump_json(exclude_none=True), media_type="application/json")
