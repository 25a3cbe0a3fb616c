"""POST /v1/rerank (also /rerank and /v2/rerank, as vLLM): Jina's and Cohere's rerank API, and vLLM's pair
scoring (`text_1`, `text_2` on /v1/score). On a cross-encoder (`BertForSequenceClassification`) each document
is paired with the query (`[CLS] query [SEP] document [SEP]`, token types 0 then 1) and scored by the model,
all pairs in one batch of the embedding scheduler; on an embedding model the score is the cosine similarity
of the two texts' embeddings, as vLLM scores with one. Results come sorted by relevance, the best `top_n`.

On a generative model (a decoder-only reranker such as Qwen3-Reranker: SGLang scores those on its generative
server by next-token logprobs, vLLM by the two label rows of the LM head) each pair is asked as a yes/no
question in Qwen3-Reranker's prompt, rendered with the model's own chat template (thinking off), and the score
is P(yes) / (P(yes) + P(no)) of the next token: the scheduler's scoring rows (label logprobs after a
prefill-only request), as /v1/score's label scoring.

The relevance score is what sentence-transformers' CrossEncoder.predict gives: the sigmoid of a one-label
model's logit (or the activation its config names: `sentence_transformers.activation_fn`, Identity keeps the
raw logit), and for a model of several labels the softmax probability of its last label.
"""

from __future__ import annotations

import math
import time
import uuid
import weakref
from typing import Any

from fastapi import Request
from pydantic import BaseModel, Field

from servelm.entrypoints.http_common import bad
from servelm.entrypoints.openai_protocol import _Response, _TopRequest
from servelm.entrypoints.serving_embedding import MAX_INPUTS, ServingEmbedding, decode_vector
from servelm.sampling_params import input_length_error


class RerankDocument(BaseModel):
    text: str


class RerankRequest(_TopRequest):
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # vLLM's: cut each pair to this many
    instruction: str | None = None  # a decoder reranker's task line (SGLang's); RERANK_INSTRUCTION when unset


# A decoder-only reranker's question, as Qwen3-Reranker's model card and SGLang's template put it.
RERANK_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
                 'Note that the answer can only be "yes" or "no".')
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_MARK = "\x00servelm-rerank\x00"
_frames: weakref.WeakKeyDictionary[Any, tuple[str, str]] = weakref.WeakKeyDictionary()  # by tokenizer


def rerank_frame(tokenizer: Any) -> tuple[str, str]:
    """The text before and after the user turn of a decoder reranker's prompt: the model's chat template with
    RERANK_SYSTEM as the system turn, the generation prompt and thinking off (for a Qwen3 template exactly
    Qwen3-Reranker's prefix and suffix), or Qwen3-Reranker's own ChatML frame for a tokenizer without one."""
    frame = _frames.get(tokenizer)
    if frame is None:
        messages = [{"role": "system", "content": RERANK_SYSTEM}, {"role": "user", "content": _MARK}]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 enable_thinking=False)
        except Exception:  # no chat template (or one without a system turn)
            text = ""
        if not isinstance(text, str) or text.count(_MARK) != 1:
            text = (f"<|im_start|>system\n{RERANK_SYSTEM}<|im_end|>\n<|im_start|>user\n{_MARK}<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n\n</think>\n\n")
        before, after = text.split(_MARK)
        frame = _frames[tokenizer] = (before, after)
    return frame


def yes_no_ids(tokenizer: Any) -> tuple[int, int] | None:
    """The vocabulary ids of the tokens `yes` and `no` (as Qwen3-Reranker's reference code looks them up), or
    None when either is not one token of this vocabulary."""
    ids = []
    for word in ("yes", "no"):
        t = tokenizer.convert_tokens_to_ids(word)
        if not isinstance(t, int) or t < 0 or t == tokenizer.unk_token_id:
            return None
        ids.append(t)
    return ids[0], ids[1]


class ClassifyRequest(_TopRequest):
    """vLLM's POST /classify: each input through a sequence-classification model."""

    model: str | None = None
    input: str | list[str]
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)


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


def probabilities(logits: list[float]) -> list[float]:
    """A classifier's class probabilities: the softmax of its logits, the sigmoid of a one-label model's."""
    if len(logits) == 1:
        return [1.0 / (1.0 + math.exp(-logits[0]))]
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = sum(weights)
    return [w / total for w in weights]


def relevance(logits: list[float], activation: str | None) -> float:
    """A cross-encoder's score of one pair, as sentence-transformers' CrossEncoder.predict computes it: the
    probability of its last label (a one-label model's sigmoid), or the logit itself with an Identity
    activation."""
    if len(logits) == 1 and activation is not None and activation.rsplit(".", 1)[-1] == "Identity":
        return logits[0]
    return probabilities(logits)[-1]


class ServingRerank(ServingEmbedding):
    """POST /v1/rerank, and vLLM's pair scoring on /v1/score (`ServingScore` hands it `text_1`/`text_2`)."""

    def check_pair_model(self, name: str | None) -> str:
        """The served task: "score" (a cross-encoder), "embed" (cosine of embeddings, as vLLM scores with an
        embedding model) or "generate" (a decoder reranker's yes/no question)."""
        task = self.manager.model_info.get("task") or "generate"
        self.check_model(name, task=task)
        return task

    async def decoder_scores(self, queries: list[str], docs: list[str], instruction: str | None, keep: int | None,
                             request: Request, param: str = "documents") -> tuple[list[float], int] | Any:
        """(score of each pair, tokens read) on a generative model: P(yes) / (P(yes) + P(no)) of the token after
        each pair's question (see rerank_frame). The question is tokenized in three parts, frame, pair, frame,
        as Qwen3-Reranker's reference code does; `keep` cuts the pair's text (the document's end) to fit."""
        tokenizer = self.manager.tokenizer
        labels = yes_no_ids(tokenizer)
        if labels is None:
            raise bad(f"`{self.state.model_name}` cannot rerank: its vocabulary has no single `yes` and `no` tokens "
                      "(a decoder reranker answers with one of them); serve a cross-encoder or a Qwen3-Reranker-"
                      "style model", "model")
        if len(docs) > self.manager.max_in_flight:
            raise bad(f"{len(docs)} {param}, but the server runs at most {self.manager.max_in_flight} requests at "
                      "once; send fewer", param)
        keep = self.truncation(keep)
        before, after = rerank_frame(tokenizer)
        pre = self.manager.encode(before, add_special_tokens=False)
        post = self.manager.encode(after, add_special_tokens=False)
        if keep is not None and keep <= len(pre) + len(post):
            raise bad(f"truncate_prompt_tokens ({keep}) leaves no room for the query and document: the reranking "
                      f"prompt's frame alone is {len(pre) + len(post)} tokens", "truncate_prompt_tokens")
        task = RERANK_INSTRUCTION if instruction is None else instruction
        prompts = []
        for i, (query, doc) in enumerate(zip(queries, docs, strict=True)):
            body = self.manager.encode(f"<Instruct>: {task}\n<Query>: {query}\n<Document>: {doc}",
                                       add_special_tokens=False)
            if keep is not None:
                body = body[:keep - len(pre) - len(post)]
            ids = pre + body + post
            self.check_context(len(ids), 0, f"{param}.{i}", param)
            prompts.append(ids)
        result = await self.label_logprobs(prompts, list(labels), request, "rerank")
        if not isinstance(result, list):
            return result  # the client hung up
        scores = [1.0 / (1.0 + math.exp(no - yes)) for yes, no in result]  # the softmax of the two: P(yes)
        return scores, sum(len(p) for p in prompts)

    def pairs(self, queries: list[str], docs: list[str], keep: int | None,
              param: str = "documents") -> tuple[list[list[int]], list[list[int]]]:
        """Each (query, document) pair's (token ids, token types); a 400 naming a pair that does not fit the
        model (unless `keep` cuts the documents to fit)."""
        limit = self.manager.context_length
        tokenizer = self.manager.tokenizer
        ids, types = [], []
        for i, (query, text) in enumerate(zip(queries, docs, strict=True)):
            kw: dict[str, Any] = {"truncation": "only_second", "max_length": keep} if keep is not None else {}
            try:
                enc = tokenizer(query, text, **kw)
            except Exception as exc:  # the query alone is longer than truncate_prompt_tokens
                raise bad(f"{param}.{i}: could not be paired with the query within {keep} tokens: {exc}",
                          "truncate_prompt_tokens") from None
            error = input_length_error(len(enc["input_ids"]), limit, f"query with {param}.{i}")
            if error:
                raise bad(error, f"{param}.{i}")
            ids.append(list(enc["input_ids"]))
            types.append(list(enc.get("token_type_ids") or [0] * len(enc["input_ids"])))
        return ids, types

    async def pair_scores(self, queries: list[str], docs: list[str], keep: int | None, request: Request,
                          param: str = "documents", instruction: str | None = None) -> tuple[list[float], int] | Any:
        """(score of each pair, tokens read): a cross-encoder's relevance, an embedding model's cosine
        similarity of the two texts' embeddings (each distinct text embedded once), or a generative model's
        yes/no answer (decoder_scores). Anything else is the response of a client that hung up."""
        if len(docs) > MAX_INPUTS:
            raise bad(f"{len(docs)} {param}; at most {MAX_INPUTS} per request", param)
        if (self.manager.model_info.get("task") or "generate") == "generate":
            return await self.decoder_scores(queries, docs, instruction, keep, request, param)
        if instruction is not None:  # never dropped silently
            raise bad("instruction is a decoder reranker's (a generative model's); this model scores pairs "
                      "without one", "instruction")
        keep = self.truncation(keep)
        if self.manager.model_info.get("task") == "embed":
            limit = self.manager.context_length
            texts = list(dict.fromkeys([*queries, *docs]))
            tokenizer = self.manager.tokenizer
            prompts = []
            for text in texts:
                kw: dict[str, Any] = {"truncation": True, "max_length": keep} if keep is not None else {}
                ids = list(tokenizer(text, **kw)["input_ids"])
                error = input_length_error(len(ids), limit, "text")
                if error:
                    raise bad(error, param if text in docs else "query")
                prompts.append(ids)
            pooled = await self.pooled(prompts, "score", request, "embedded", param)
            if not isinstance(pooled, tuple):
                return pooled
            vectors = {text: decode_vector(v) for text, v in zip(texts, pooled[1], strict=True)}
            scores = [cosine(vectors[q], vectors[d]) for q, d in zip(queries, docs, strict=True)]
            return scores, sum(len(p) for p in prompts)
        ids, types = self.pairs(queries, docs, keep, param)
        pooled = await self.pooled(ids, "score", request, "scored", param, token_type_ids=types)
        if not isinstance(pooled, tuple):
            return pooled
        activation = self.manager.model_info.get("activation")
        scores = [relevance(list(decode_vector(v)), activation) for v in pooled[1]]
        return scores, sum(len(x) for x in ids)

    async def rerank(self, req: RerankRequest, request: Request) -> Any:
        self.check_pair_model(req.model)
        if not req.documents:
            raise bad("documents must not be empty", "documents")
        texts = [doc if isinstance(doc, str) else doc.text for doc in req.documents]
        scored = await self.pair_scores([req.query] * len(texts), texts, req.truncate_prompt_tokens, request,
                                        instruction=req.instruction)
        if not isinstance(scored, tuple):
            return scored  # the client hung up
        scores, tokens = scored
        results = [RerankResult(index=i, relevance_score=score,
                                document=RerankDocument(text=texts[i]) if req.return_documents else None)
                   for i, score in enumerate(scores)]
        results.sort(key=lambda r: -r.relevance_score)
        return RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=self.state.model_name,
                              results=results[:req.top_n], usage=RerankUsage(total_tokens=tokens))

    async def score_pairs(self, text_1: str | list[str], text_2: str | list[str], keep: int | None,
                          request: Request, instruction: str | None = None) -> Any:
        """vLLM's POST /v1/score: `text_1` against each of `text_2` (one to many), or pairwise (equal lists)."""
        first = [text_1] if isinstance(text_1, str) else list(text_1)
        second = [text_2] if isinstance(text_2, str) else list(text_2)
        if not first or not second:
            raise bad("text_1 and text_2 must not be empty", "text_1" if not first else "text_2")
        if len(first) == 1:
            first = first * len(second)
        elif len(first) != len(second):
            raise bad(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many as "
                      "text_2", "text_2")
        scored = await self.pair_scores(first, second, keep, request, param="text_2", instruction=instruction)
        if not isinstance(scored, tuple):
            return scored
        scores, tokens = scored
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.state.model_name,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}


    async def classify(self, req: ClassifyRequest, request: Request) -> Any:
        """vLLM's /classify on a BertForSequenceClassification model: each input's class probabilities (the
        softmax of its logits; the sigmoid of a one-label model's), and the most likely label by the model's
        config.id2label."""
        self.check_model(req.model, task="score")
        prompts = self.inputs(req.input, req.truncate_prompt_tokens)
        pooled = await self.pooled(prompts, "classify", request, "classified", "input")
        if not isinstance(pooled, tuple):
            return pooled
        rid, vectors = pooled
        labels = self.manager.model_info.get("id2label") or {}
        data = []
        for index, vector in enumerate(vectors):
            probs = probabilities(list(decode_vector(vector)))
            best = max(range(len(probs)), key=probs.__getitem__) if len(probs) > 1 else int(probs[0] > 0.5)
            data.append({"index": index, "label": labels.get(str(best), f"LABEL_{best}"), "probs": probs,
                         "num_classes": len(probs)})
        tokens = sum(len(p) for p in prompts)
        return {"id": rid, "object": "list", "created": int(time.time()), "model": self.state.model_name,
                "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}


def cosine(a: Any, b: Any) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norm if norm > 0 else 0.0
