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


class ServingCompletions(OpenAIServing):
    """The completions endpoint."""

    async def create(self, req: CompletionRequest, request: Request) -> Any:
        """POST /v1/completions."""
        self.check_model(req.model)
        if req.suffix:
            raise bad("suffix is not supported (no fill-in-the-middle yet)", "suffix")
        if req.best_of is not None and req.best_of not in (1, req.n):
            raise bad(f"best_of must be 1 or n (servelm returns every sample it draws), got {req.best_of}",
                      "best_of")
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts = [self.manager.encode(prompt)]
            texts: list[str | None] = [prompt]
        elif prompt and isinstance(prompt[0], str):
            prompts = [self.manager.encode(p) for p in prompt]  # type: ignore[arg-type]
            texts = list(prompt)  # type: ignore[arg-type]
        elif prompt and isinstance(prompt[0], list):
            prompts = [list(p) for p in prompt]  # type: ignore[arg-type]
            texts = [None] * len(prompts)
        else:
            prompts = [list(prompt)]  # type: ignore[arg-type]
            texts = [None]
        if not prompts:
            raise bad("prompt must not be empty", "prompt")
        for ids in prompts:
            self.check_ids(ids, "prompt")
        if req.max_tokens is not None and req.max_tokens < 1 and not (req.max_tokens == 0 and req.echo):
            raise bad(f"max_tokens must be at least 1 (0 only with echo: the prompt back, scored with logprobs), "
                      f"got {req.max_tokens}", "max_tokens")
        k = req.logprobs
        if k is not None and not 0 <= k <= 20:
            raise bad(f"logprobs must be in [0, 20], got {k}", "logprobs")
        params = self.sampling_params(req, req.max_tokens, "max_tokens", [len(p) for p in prompts], "prompt",
                                      k is not None, k or 0)
        # Echoed prompt tokens get their own logprobs (as with OpenAI's and vLLM's completions).
        params.prompt_logprobs = bool(req.echo) and k is not None
        n = params.n

        def echo_text(index: int) -> str:
            if not req.echo:
                return ""
            p = index // n
            return texts[p] if texts[p] is not None else self.manager.decode(prompts[p])  # type: ignore[return-value]

        def logprobs_of(index: int, got: TokenOut | Accumulated, offset: int, first: bool) -> CompletionLogprobs:
            ids, lps, tops = got.token_ids, list(got.logprobs), list(got.top_logprobs)
            if req.echo and first:
                p = prompts[index // n]
                ids = p + ids
                lps = list(got.prompt_logprobs or [None] * len(p)) + lps
                tops = list(got.prompt_top_logprobs or [None] * len(p)) + tops
            return self.completion_logprobs(ids, lps, tops, offset)

        rid = req.rid or random_id("cmpl")
        group = self.submit(prompts, params, rid, req.stream)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def stream() -> AsyncIterator[str]:
            created = int(time.time())
            sent_echo: set[int] = set()
            offsets = [0] * len(group.subs)

            def event(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
                return sse(CompletionResponse(id=rid, created=created, model=self.state.model_name, choices=choices,
                                              usage=usage))

            def render(index: int, out: TokenOut, acc: Accumulated) -> Iterator[str]:
                first = index not in sent_echo
                sent_echo.add(index)
                text = (echo_text(index) if first else "") + out.text
                if not text and out.finish_reason is None and not out.logprobs:
                    return
                lp = logprobs_of(index, out, offsets[index], first) if params.logprobs else None
                offsets[index] += len(text)
                yield event([CompletionChoice(index=index, text=text, logprobs=lp,
                                              finish_reason=finish_reason_str(out.finish_reason),
                                              matched_stop=matched(out.finish_reason))])

            return stream_events(group, render, (lambda accs: event([], usage([len(p) for p in prompts], accs, n)))
                                 if include_usage else None)

        result = await self.run_or_stream(group, request, stream() if req.stream else None)
        if not isinstance(result, list):
            return result
        choices = []
        for i, acc in enumerate(result):
            lp = logprobs_of(i, acc, 0, True) if params.logprobs else None
            choices.append(CompletionChoice(index=i, text=echo_text(i) + "".join(acc.text), logprobs=lp,
                                            finish_reason=finish_reason_str(acc.finish_reason),
                                            matched_stop=matched(acc.finish_reason)))
        return CompletionResponse(id=rid, model=self.state.model_name, choices=choices,
                                  usage=usage([len(p) for p in prompts], result, n))

    def completion_logprobs(self, ids: list[int], lps: list[float | None], tops: list[list[tuple[int, float]] | None],
                            offset: int) -> CompletionLogprobs:
        """Legacy OpenAI logprobs of `ids` (prompt and/or completion tokens), text offsets from `offset`."""
        result = CompletionLogprobs()
        for k, tid in enumerate(ids):
            text = self.manager.token_text(tid)
            result.tokens.append(text)
            result.token_logprobs.append(lps[k] if k < len(lps) else None)
            top = tops[k] if k < len(tops) else None
            result.top_logprobs.append(None if top is None else {self.manager.token_text(t): lp for t, lp in top})
            result.text_offset.append(offset)
            offset += len(text)
        return result
