"""SGLang's `/v1/score`: how likely each label token is to come next after `query` + each of `items`.

Each item becomes one prompt (`query + item`, or `item + query` with `item_first`; text is concatenated
before tokenizing, token ids as lists), run as a prefill-only request whose final output carries the raw
logprobs of `label_token_ids` at the position after the prompt (the scheduler's scoring rows). As SGLang:
`scores[i][j]` is the probability of label j after item i, `exp(logprob)`, or with `apply_softmax` the
softmax over the label tokens' logprobs (the labels' probabilities renormalised to sum to 1).
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import Request
from pydantic import Field

from servelm.entrypoints.http_common import bad
from servelm.entrypoints.openai_protocol import UsageInfo, _Response, _TopRequest
from servelm.entrypoints.serving_base import OpenAIServing


class ScoreRequest(_TopRequest):
    """SGLang's ScoringRequest (text query and items, or token-id query and items, with label_token_ids), or
    on a cross-encoder or embedding model vLLM's pair scoring (`text_1`, `text_2`; or query and text items)."""

    model: str | None = None
    query: str | list[int] | None = None
    items: str | list[str] | list[list[int]] | None = None
    label_token_ids: list[int] | None = None
    apply_softmax: bool = False
    item_first: bool = False
    text_1: str | list[str] | None = None  # vLLM's
    text_2: str | list[str] | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    instruction: str | None = None  # pairs on a decoder reranker: its task line (serving_rerank.RERANK_INSTRUCTION)


class ScoreResponse(_Response):
    scores: list[list[float]]
    model: str
    usage: UsageInfo
    object: str = "scoring"


def label_scores(logprobs: list[float], apply_softmax: bool) -> list[float]:
    """Probabilities of the labels: exp of each logprob, or their softmax (SGLang's two modes)."""
    if not apply_softmax:
        return [math.exp(lp) for lp in logprobs]
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


class ServingScore(OpenAIServing):
    """POST /v1/score."""

    def check_vocab(self, ids: list[int], param: str) -> None:
        """SGLang's wording for a token id outside the vocabulary (its clients match on it)."""
        vocab = self.manager.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise bad(f"Token ID {t} is out of vocabulary (vocab size: {vocab})", param)

    def prompts(self, req: ScoreRequest) -> list[list[int]]:
        """The token ids of each item's prompt (query and item in the requested order)."""
        items = [req.items] if isinstance(req.items, str) else list(req.items)
        if not items:
            raise bad("items must not be empty", "items")
        if isinstance(req.query, str):
            if not all(isinstance(item, str) for item in items):
                raise bad("items must be text when query is text", "items")
            texts = [f"{item}{req.query}" if req.item_first else f"{req.query}{item}" for item in items]
            return [self.manager.encode(text) for text in texts]
        if not all(isinstance(item, list) for item in items):
            raise bad("items must be lists of token ids when query is token ids", "items")
        for item in items:
            self.check_vocab(item, "items")  # type: ignore[arg-type]
        self.check_vocab(req.query, "query")
        return [list(item) + req.query if req.item_first else req.query + list(item) for item in items]  # type: ignore[operator]

    async def score(self, req: ScoreRequest, request: Request) -> ScoreResponse | Any:
        pairs = req.text_1 is not None or req.text_2 is not None
        if self.manager.model_info.get("task") in ("score", "embed") or pairs:
            return await self.score_pairs(req, request)
        self.check_model(req.model)
        if req.instruction is not None:
            raise bad("instruction goes with text_1 and text_2 (pair scoring by a decoder reranker), not with "
                      "label_token_ids", "instruction")
        if req.truncate_prompt_tokens is not None:  # never dropped silently
            raise bad("truncate_prompt_tokens applies to pair scoring (a cross-encoder or an embedding model), "
                      "not to label scoring", "truncate_prompt_tokens")
        if req.query is None:
            raise bad("query is required", "query")
        if req.items is None:
            raise bad("items is required", "items")
        if not req.label_token_ids:
            raise bad("label_token_ids must not be empty", "label_token_ids")
        self.check_vocab(req.label_token_ids, "label_token_ids")
        prompts = self.prompts(req)
        if len(prompts) > self.manager.max_in_flight:
            raise bad(f"{len(prompts)} items, but the server runs at most {self.manager.max_in_flight} requests at "
                      "once; send fewer", "items")
        for ids in prompts:
            if not ids:
                raise bad("query and item must not both be empty", "query")
            self.check_context(len(ids), 0, "items", "items")
        result = await self.label_logprobs(prompts, req.label_token_ids, request, "score")
        if not isinstance(result, list):
            return result  # the client hung up
        scores = [label_scores(logprobs, req.apply_softmax) for logprobs in result]
        prompt_tokens = sum(len(p) for p in prompts)
        return ScoreResponse(scores=scores, model=self.state.model_name,
                             usage=UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=0,
                                             total_tokens=prompt_tokens))

    async def score_pairs(self, req: ScoreRequest, request: Request) -> Any:
        """vLLM's pair scoring (a cross-encoder, an embedding model, or a generative model as a yes/no
        reranker): `text_1` with `text_2`, or on a cross-encoder or embedding model SGLang's text `query` with
        `items`."""
        from servelm.entrypoints.serving_rerank import ServingRerank

        rerank = ServingRerank(self.state)
        if rerank.check_pair_model(req.model) == "generate":  # here because text_1 or text_2 came
            if req.label_token_ids is not None:
                raise bad("label_token_ids goes with query and items (label scoring), not with text_1 and text_2 "
                          "(pairs scored as a yes/no reranker)", "label_token_ids")
        elif req.label_token_ids is not None:
            raise bad("label_token_ids scores a generative model's next token; this model scores pairs: send "
                      "text_1 and text_2", "label_token_ids")
        if req.text_1 is None and req.text_2 is None:
            if not isinstance(req.query, str) or req.items is None or \
                    not all(isinstance(i, str) for i in ([req.items] if isinstance(req.items, str) else req.items)):
                raise bad("send text_1 and text_2 (or a text query and text items) to score pairs", "text_1")
            return await rerank.score_pairs(req.query, req.items, req.truncate_prompt_tokens,  # type: ignore[arg-type]
                                            request, req.instruction)
        if req.text_1 is None or req.text_2 is None:
            raise bad("text_1 and text_2 are both required", "text_1" if req.text_1 is None else "text_2")
        return await rerank.score_pairs(req.text_1, req.text_2, req.truncate_prompt_tokens, request, req.instruction)
