"""POST /v1/completions: text or token-id prompts (one or a batch), echo (with the prompt's logprobs),
structured output; streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request

from servelm.entrypoints.http_common import bad
from servelm.entrypoints.openai_protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from servelm.entrypoints.serving_base import OpenAIServing
from servelm.entrypoints.streaming import Accumulated, finish_reason_str, matched, sse, stream_events, usage
from servelm.managers.io_struct import TokenOut
from servelm.managers.tokenizer_manager import RequestGroup


class ServingCompletions(OpenAIServing):
    """The completions endpoint."""

    def prompts_of(self, req: CompletionRequest) -> tuple[list[list[int]], list[str | None]]:
        """The prompts' token ids (checked, truncated if asked) and their texts (None for token-id prompts)."""
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts, texts = [self.manager.encode(prompt)], [prompt]
        elif prompt and isinstance(prompt[0], str):
            prompts = [self.manager.encode(p) for p in prompt]  # type: ignore[arg-type]
            texts = list(prompt)  # type: ignore[arg-type]
        elif prompt and isinstance(prompt[0], list):
            prompts = [list(p) for p in prompt]  # type: ignore[arg-type]
            texts = [None] * len(prompts)
        else:
            prompts, texts = [list(prompt)], [None]  # type: ignore[arg-type]
        if not prompts:
            raise bad("prompt must not be empty", "prompt")
        if req.truncate_prompt_tokens is not None:
            prompts = [self.truncate(p, req.truncate_prompt_tokens, req.truncation_side) for p in prompts]
            texts = [None] * len(prompts)  # echo shows what the model read
        for ids in prompts:
            self.check_ids(ids, "prompt")
        return prompts, texts

    def check(self, req: CompletionRequest) -> None:
        self.check_model(req.model)
        if req.suffix:
            raise bad("suffix is not supported (no fill-in-the-middle yet)", "suffix")
        if req.best_of is not None and req.best_of not in (1, req.n):
            raise bad(f"best_of {req.best_of} > n is not supported: servelm has no beam search and does not rank "
                      f"samples; best_of must be 1 or n", "best_of")
        if req.max_tokens is not None and req.max_tokens < 1 and not (req.max_tokens == 0 and req.echo):
            raise bad(f"max_tokens must be at least 1 (0 only with echo: the prompt back, scored with logprobs), "
                      f"got {req.max_tokens}", "max_tokens")
        req.logprobs = self.logprobs_count(req.logprobs, "logprobs")

    async def create(self, req: CompletionRequest, request: Request) -> Any:
        """POST /v1/completions."""
        if self.state.server_args.return_tokens_as_token_ids:
            req.return_tokens_as_token_ids = True
        self.check(req)
        prompts, texts = self.prompts_of(req)
        k = req.logprobs
        params = self.sampling_params(req, req.max_tokens, "max_tokens", [len(p) for p in prompts], "prompt",
                                      k is not None, k or 0)
        # Echoed prompt tokens get their own logprobs (as with OpenAI's and vLLM's completions).
        if req.echo and k is not None:
            params.prompt_logprobs = True
            params.prompt_top_logprobs = max(k, req.prompt_logprobs or 0)
        rid = req.rid or random_id("cmpl")
        group = self.submit(prompts, params, rid, req.stream)
        view = CompletionView(self, req, prompts, texts, params.n)
        result = await self.run_or_stream(group, request, view.stream(rid, group) if req.stream else None)
        if not isinstance(result, list):
            return result
        return CompletionResponse(id=rid, model=self.state.model_name, choices=[
            view.choice(i, acc, acc, 0, first=True) for i, acc in enumerate(result)],
            usage=usage([len(p) for p in prompts], result, params.n))

    def completion_logprobs(self, ids: list[int], lps: list[float | None], tops: list[list[tuple[int, float]] | None],
                            offset: int, as_ids: bool = False) -> CompletionLogprobs:
        """Legacy OpenAI logprobs of `ids` (prompt and/or completion tokens), text offsets from `offset`: each
        token's top alternatives, the chosen token first (as vLLM lists them), then the others (up to k + 1
        entries, as OpenAI)."""
        result = CompletionLogprobs()
        for k, tid in enumerate(ids):
            text = self.manager.token_text(tid)
            lp = lps[k] if k < len(lps) else None
            result.tokens.append(self.token_str(tid, as_ids))
            result.token_logprobs.append(lp)
            top = tops[k] if k < len(tops) else None
            if top is None and lp is None:
                result.top_logprobs.append(None)
            else:
                chosen = dict(top or []).get(tid, lp)
                alternatives = {self.token_str(tid, as_ids): chosen}
                for t, v in top or []:
                    alternatives.setdefault(self.token_str(t, as_ids), v)
                result.top_logprobs.append(alternatives)
            result.text_offset.append(offset)
            offset += len(text)
        return result


class CompletionView:
    """How one completions request's outputs read: echo, logprobs, prompt logprobs and token ids per choice,
    streamed (with usage on every chunk when asked) or whole."""

    def __init__(self, serving: ServingCompletions, req: CompletionRequest, prompts: list[list[int]],
                 texts: list[str | None], n: int) -> None:
        self.serving, self.req, self.prompts, self.texts, self.n = serving, req, prompts, texts, n

    def echo_text(self, index: int) -> str:
        if not self.req.echo:
            return ""
        p = index // self.n
        return self.texts[p] if self.texts[p] is not None else self.serving.manager.decode(self.prompts[p])  # type: ignore[return-value]

    def logprobs(self, index: int, got: TokenOut | Accumulated, offset: int, first: bool) -> CompletionLogprobs:
        ids, lps, tops = got.token_ids, list(got.logprobs), list(got.top_logprobs)
        if self.req.echo and first:
            p = self.prompts[index // self.n]
            ids = p + ids
            lps = list(got.prompt_logprobs or [None] * len(p)) + lps
            prompt_tops = [t and t[:self.req.logprobs] for t in got.prompt_top_logprobs or [None] * len(p)]
            tops = prompt_tops + tops
        return self.serving.completion_logprobs(ids, lps, tops, offset, self.req.return_tokens_as_token_ids)

    def choice(self, index: int, out: TokenOut | Accumulated, acc: Accumulated, offset: int,
               first: bool) -> CompletionChoice:
        """The choice of `out` (a streamed output, or all of one): `first` carries the echo and prompt data."""
        req, prompt = self.req, self.prompts[index // self.n]
        text = (self.echo_text(index) if first else "") + "".join(out.text)
        with_ids = req.return_token_ids
        return CompletionChoice(
            index=index, text=text, finish_reason=finish_reason_str(out.finish_reason),
            matched_stop=matched(out.finish_reason),
            logprobs=self.logprobs(index, out, offset, first) if req.logprobs is not None else None,
            prompt_logprobs=(self.serving.vllm_prompt_logprobs(prompt, acc, req.prompt_logprobs,
                                                               req.return_tokens_as_token_ids)
                             if first and req.prompt_logprobs is not None else None),
            prompt_token_ids=prompt if with_ids and first else None,
            token_ids=(out.token_ids or None) if with_ids else None)  # only on a choice that carries tokens

    def stream(self, rid: str, group: RequestGroup) -> AsyncIterator[str]:
        created = int(time.time())
        started: set[int] = set()
        offsets = [0] * len(group.subs)
        options = self.req.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options and options.continuous_usage_stats)

        def event(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            return sse(CompletionResponse(id=rid, created=created, model=self.serving.state.model_name,
                                          choices=choices, usage=usage))

        def render(index: int, out: TokenOut, acc: Accumulated) -> Iterator[str]:
            first = index not in started
            started.add(index)
            choice = self.choice(index, out, acc, offsets[index], first)
            ids_due = self.req.return_token_ids and (first or out.token_ids)
            if not choice.text and out.finish_reason is None and not out.logprobs and not ids_due:
                return
            offsets[index] += len(choice.text)
            yield event([choice], usage([len(self.prompts[index // self.n])], [acc], 1) if continuous else None)

        lens = [len(p) for p in self.prompts]
        return stream_events(group, render, (lambda accs: event([], usage(lens, accs, self.n)))
                             if include_usage else None)
