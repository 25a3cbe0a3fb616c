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
    """POST /v1/embeddings and /pooling; the helpers of every route an embedding server answers."""

    def truncation(self, value: int | None) -> int | None:
        """vLLM's `truncate_prompt_tokens` as a token count (-1: the model's limit); a 400 above the limit."""
        limit = self.manager.context_length
        keep = limit if value == -1 else value
        if keep is not None and keep > limit:
            raise bad(f"truncate_prompt_tokens ({keep}) is more than the model's context length ({limit} tokens)",
                      "truncate_prompt_tokens")
        return keep

    async def pooled(self, prompts: list[list[int]], prefix: str, request: Request, what: str, param: str,
                     token_type_ids: list[list[int]] | None = None) -> tuple[str, list[str]] | Any:
        """Run `prompts` through the model: (request id, each prompt's vector as float32 in base64), or the
        response of a client that hung up (not a tuple). `what` and `param` name a prompt that came back without
        one."""
        rid = f"{prefix}-{uuid.uuid4().hex}"
        group = self.submit(prompts, SamplingParams(max_new_tokens=0), rid, False, token_type_ids=token_type_ids)
        result = await self.run_or_stream(group, request, None)
        if not isinstance(result, list):
            return result
        vectors = []
        for index, acc in enumerate(result):
            if acc.embedding is None:  # a failure is raised by run_or_stream before this
                raise bad(f"{param}.{index} was not {what}", param)
            vectors.append(acc.embedding)
        return rid, vectors

    def inputs(self, raw: str | list[str] | list[int] | list[list[int]], keep: int | None,
               add_special_tokens: bool = True) -> list[list[int]]:
        """Every input's token ids, each checked against the vocabulary and the model's input limit (cut to
        `keep` tokens first, vLLM's `truncate_prompt_tokens`: the tokenizer's side for text, the end for token
        ids)."""
        if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw)):
            items: list[Any] = [raw]
        else:
            items = list(raw)
        if not items:
            raise bad("input must not be empty", "input")
        if len(items) > MAX_INPUTS:
            raise bad(f"input has {len(items)} items; at most {MAX_INPUTS} per request", "input")
        limit = self.manager.context_length
        keep = self.truncation(keep)
        tokenizer = self.manager.tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        backend = backend if backend is not None and backend.truncation is None else None
        out = []
        for i, item in enumerate(items):
            where = "input" if len(items) == 1 else f"input.{i}"
            if isinstance(item, str):
                if keep is not None:
                    ids = tokenizer(item, add_special_tokens=add_special_tokens, truncation=True,
                                    max_length=keep)["input_ids"]
                elif backend is not None:  # the Rust tokenizer itself: half the time of the HF call
                    ids = backend.encode(item, add_special_tokens=add_special_tokens).ids
                else:
                    ids = tokenizer(item, add_special_tokens=add_special_tokens)["input_ids"]
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
        inputs = self.inputs(req.input, req.truncate_prompt_tokens, req.add_special_tokens)
        pooled = await self.pooled(inputs, "pool", request, "pooled", "input")
        if not isinstance(pooled, tuple):
            return pooled  # the client hung up
        rid, vectors = pooled
        data = [PoolingData(index=index, data=vector if req.encoding_format == "base64"
                            else decode_vector(vector).tolist()).model_dump()
                for index, vector in enumerate(vectors)]
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
        inputs = self.inputs(req.input, req.truncate_prompt_tokens, req.add_special_tokens)
        pooled = await self.pooled(inputs, "embd", request, "embedded", "input")
        if not isinstance(pooled, tuple):
            return pooled  # the client hung up
        rid, vectors = pooled
        data = []
        normalize = bool(info.get("normalize"))
        for index, raw in enumerate(vectors):
            if req.dimensions is None and req.encoding_format == "base64":
                vector: list[float] | str = raw
            else:
                vec = decode_vector(raw)
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
