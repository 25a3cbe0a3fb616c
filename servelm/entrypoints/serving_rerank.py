"""POST /v1/rerank (also /rerank and /v2/rerank, as vLLM): Jina's and Cohere's rerank API on a cross-encoder
(`BertForSequenceClassification`). Each document is paired with the query (`[CLS] query [SEP] document
[SEP]`, token types 0 then 1) and scored by the model in one batch of the embedding scheduler; results come
sorted by relevance, the best `top_n`.

The relevance score is what sentence-transformers' CrossEncoder.predict gives: the sigmoid of a one-label
model's logit (or the activation its config names: `sentence_transformers.activation_fn`, Identity keeps the
raw logit), and for a model of several labels the softmax probability of its last label.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

from fastapi import Request
from pydantic import BaseModel, Field

from servelm.entrypoints.http_common import bad
from servelm.entrypoints.openai_protocol import _Response, _TopRequest
from servelm.entrypoints.serving_base import OpenAIServing
from servelm.entrypoints.serving_embedding import MAX_INPUTS, decode_vector
from servelm.sampling_params import SamplingParams, input_length_error


class RerankDocument(BaseModel):
    text: str


class RerankRequest(_TopRequest):
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # vLLM's: cut each pair to this many


class RerankResult(_Response):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(_Response):
    total_tokens: int


class RerankResponse(_Response):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def relevance(logits: list[float], activation: str | None) -> float:
    """A cross-encoder's score of one pair, as sentence-transformers' CrossEncoder.predict computes it."""
    if len(logits) > 1:
        top = max(logits)
        weights = [math.exp(x - top) for x in logits]
        return weights[-1] / sum(weights)
    if activation is not None and activation.rsplit(".", 1)[-1] == "Identity":
        return logits[0]
    return 1.0 / (1.0 + math.exp(-logits[0]))


class ServingRerank(OpenAIServing):
    """POST /v1/rerank."""

    def pairs(self, req: RerankRequest) -> tuple[list[list[int]], list[list[int]]]:
        """Each document's (token ids, token types) with the query first; a 400 naming a document that does
        not fit the model (unless truncate_prompt_tokens cuts the documents to fit)."""
        limit = self.manager.context_length
        keep = limit if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens
        if keep is not None and keep > limit:
            raise bad(f"truncate_prompt_tokens ({keep}) is more than the model's context length ({limit} tokens)",
                      "truncate_prompt_tokens")
        tokenizer = self.manager.tokenizer
        ids, types = [], []
        for i, doc in enumerate(req.documents):
            text = doc if isinstance(doc, str) else doc.text
            kw: dict[str, Any] = {"truncation": "only_second", "max_length": keep} if keep is not None else {}
            try:
                enc = tokenizer(req.query, text, **kw)
            except Exception as exc:  # the query alone is longer than truncate_prompt_tokens
                raise bad(f"documents.{i}: could not be paired with the query within {keep} tokens: {exc}",
                          "truncate_prompt_tokens") from None
            error = input_length_error(len(enc["input_ids"]), limit, f"query with documents.{i}")
            if error:
                raise bad(error, f"documents.{i}")
            ids.append(list(enc["input_ids"]))
            types.append(list(enc.get("token_type_ids") or [0] * len(enc["input_ids"])))
        return ids, types

    async def rerank(self, req: RerankRequest, request: Request) -> Any:
        self.check_model(req.model, task="score")
        if not req.documents:
            raise bad("documents must not be empty", "documents")
        if len(req.documents) > MAX_INPUTS:
            raise bad(f"{len(req.documents)} documents; at most {MAX_INPUTS} per request", "documents")
        ids, types = self.pairs(req)
        rid = f"rerank-{uuid.uuid4().hex}"
        group = self.submit(ids, SamplingParams(max_new_tokens=0), rid, False, token_type_ids=types)
        result = await self.run_or_stream(group, request, None)
        if not isinstance(result, list):
            return result  # the client hung up
        activation = self.manager.model_info.get("activation")
        results = []
        for index, acc in enumerate(result):
            if acc.embedding is None:
                raise bad(f"documents.{index} was not scored", "documents")
            doc = req.documents[index]
            results.append(RerankResult(
                index=index, relevance_score=relevance(list(decode_vector(acc.embedding)), activation),
                document=(RerankDocument(text=doc) if isinstance(doc, str) else doc) if req.return_documents else None))
        results.sort(key=lambda r: -r.relevance_score)
        return RerankResponse(id=rid, model=self.state.model_name, results=results[:req.top_n],
                              usage=RerankUsage(total_tokens=sum(len(x) for x in ids)))
