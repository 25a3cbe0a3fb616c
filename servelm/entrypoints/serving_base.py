"""What every OpenAI-style endpoint does with a request, whatever its shape (as vLLM's `OpenAIServing`):
check the model name and token ids, build and validate the sampling params (400s naming the field),
submit to the scheduler (429 when full), then collect the outputs or hand back a stream.
"""

from __future__ import annotations

import functools
import json
import logging
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from servelm.constrained import choice_regex
from servelm.entrypoints import reasoning, tool_parsers
from servelm.entrypoints.http_common import ApiError, bad
from servelm.entrypoints.openai_protocol import ResponseFormat
from servelm.entrypoints.reasoning import ReasoningFormat, ReasoningStream
from servelm.entrypoints.streaming import Accumulated, ClientGone, collect, error_of
from servelm.managers.tokenizer_manager import (
    CapacityError,
    DuplicateRequestIdError,
    QueueFullError,
    RequestGroup,
    SchedulerUnavailableError,
)
from servelm.sampling_params import (
    SamplingParams,
    SamplingParamsError,
    context_length_error,
    token_ids_error,
    top_logprobs_error,
)

if TYPE_CHECKING:
    from servelm.entrypoints.server_state import ServerState

logger = logging.getLogger(__name__)


def schema_text(schema: str | dict[str, Any] | None) -> str | None:
    """A JSON schema as the JSON text SamplingParams carries (SGLang sends text, vLLM an object)."""
    return schema if schema is None or isinstance(schema, str) else json.dumps(schema)


def constraints_of(req: Any) -> list[tuple[str, str, str]]:
    """(SamplingParams field, value, request field) of every constraint a chat or completions request asks
    for, in any of OpenAI's, SGLang's and vLLM's spellings; more than one is the caller's 400."""
    so = req.structured_outputs
    for name, choices in (("guided_choice", req.guided_choice), ("structured_outputs.choice", so and so.choice)):
        if choices is not None and not choices:
            raise bad(f"{name} must be a non-empty list of strings", name.split(".")[0])
    candidates = [
        ("json_schema", json_schema_of(req.response_format), "response_format"),
        ("json_schema", schema_text(req.json_schema), "json_schema"),
        ("json_schema", schema_text(req.guided_json), "guided_json"),
        ("regex", req.regex, "regex"),
        ("regex", req.guided_regex, "guided_regex"),
        ("regex", choice_regex(req.guided_choice) if req.guided_choice else None, "guided_choice"),
        ("ebnf", req.ebnf, "ebnf"),
        ("ebnf", req.guided_grammar, "guided_grammar"),
    ]
    if so is not None:
        candidates += [
            ("json_schema", schema_text(so.json_), "structured_outputs.json"),
            ("json_schema", '{"type": "object"}' if so.json_object else None, "structured_outputs.json_object"),
            ("regex", so.regex, "structured_outputs.regex"),
            ("regex", choice_regex(so.choice) if so.choice else None, "structured_outputs.choice"),
            ("ebnf", so.grammar, "structured_outputs.grammar"),
        ]
    return [c for c in candidates if c[1] is not None]


def check_request_options(req: Any) -> None:
    """400s for option combinations that cannot be served: stream_options without stream, beam search,
    prompt_logprobs out of range or streamed (truncate_prompt_tokens: `OpenAIServing.truncate`)."""
    if req.stream_options is not None and not req.stream:
        raise bad("stream_options can only be given when stream is true", "stream_options")
    if req.use_beam_search:
        raise bad("use_beam_search: beam search is not supported by servelm", "use_beam_search")
    if req.prompt_logprobs is not None:  # its range: OpenAIServing.logprobs_count
        if req.stream:
            raise bad("prompt_logprobs is not available when stream is true", "prompt_logprobs")


def json_schema_of(fmt: ResponseFormat | None) -> str | None:
    """The JSON schema (as a string) that OpenAI's response_format asks the output to follow, if any."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return '{"type": "object"}' if fmt.schema_ is None else json.dumps(fmt.schema_)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise bad("response_format: type json_schema needs json_schema.schema", "response_format")
    return json.dumps(fmt.json_schema.schema_)


class OpenAIServing:
    """The shared half of the endpoints; `ServingChat`, `ServingCompletions` and `ServingNative` add theirs."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.manager = state.manager

    def _chat_template(self) -> str | None:
        template = getattr(self.manager.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    @functools.cached_property
    def _reasoning_format(self) -> ReasoningFormat | None:
        name = self.state.server_args.reasoning_parser
        fmt = reasoning.resolve(name, self._chat_template())
        if name is not None:
            logger.info("reasoning parser: %s", fmt.name if fmt else f"none ({name}: the chat template shows no "
                        "<think> markers)")
        return fmt

    def reasoning_format(self) -> ReasoningFormat | None:
        """The --reasoning-parser format (auto: from the chat template), resolved on first use (the tokenizer
        arrives after the endpoints are built)."""
        return self._reasoning_format

    @functools.cached_property
    def _tool_parser_name(self) -> str | None:
        name = self.state.server_args.tool_call_parser
        resolved = tool_parsers.resolve(name, self._chat_template())
        if name == "auto":
            logger.info("tool-call parser: %s", resolved or "none (the chat template shows no known tool-call format)")
        return resolved

    def tool_parser_name(self) -> str | None:
        """The --tool-call-parser (auto: picked from the chat template, None when it shows no known format)."""
        return self._tool_parser_name

    def reasoning_stream(self, prompt: list[int], tools: Any = None) -> ReasoningStream | None:
        """A splitter for one output of `prompt` (None without a reasoning parser). `tools`: the request's
        ToolPlan (a harmony splitter hands the `openai` tool parser the output as written)."""
        fmt = self.reasoning_format()
        if fmt is None:
            return None
        if fmt.harmony:
            from servelm.entrypoints.harmony import HarmonyReasoningStream

            parser = getattr(tools, "parser", None)
            return HarmonyReasoningStream(fmt, self.manager.tokenizer,  # type: ignore[return-value]
                                          markup=getattr(parser, "name", None) == "openai")
        return ReasoningStream(fmt, reasoning.prompt_tail(self.manager, prompt))

    def prepare_reasoning(self, params: SamplingParams, prompt: list[int]) -> None:
        """With a reasoning parser: the output keeps its markers when they are special tokens, and a constrained
        output (tools, response_format) is left free while the model thinks: the constraint starts after the
        closing marker (SGLang's choice; the scheduler's `gate`)."""
        fmt = self.reasoning_format()
        if fmt is None:
            return
        special = set(getattr(self.manager.tokenizer, "all_special_tokens", []) or [])
        if fmt.harmony or fmt.start in special or fmt.end in special:  # the parser must see the markers
            params.skip_special_tokens = False
        constrained = bool(params.json_schema or params.regex or params.ebnf)
        if fmt.harmony:
            if constrained:  # the answer's place is a message header of several tokens, not one marker
                raise bad(f"structured output and a tool_choice that forces a call are not supported with "
                          f"--reasoning-parser {fmt.name} yet (harmony); use tool_choice auto with "
                          "--tool-call-parser openai", "response_format")
            return
        stream = self.reasoning_stream(prompt)
        if stream is None or not constrained or stream.state == "answer":
            return
        tokenizer = self.manager.tokenizer
        end = reasoning.marker_token(tokenizer, fmt.end)
        if end is None:
            raise bad(f"structured output and tool calls with --reasoning-parser {fmt.name} need '{fmt.end}' to be "
                      "one token of this model's tokenizer; it is not", "response_format")
        start = reasoning.marker_token(tokenizer, fmt.start)
        params.constraint_after = [end] if stream.state == "inside" or start is None else [start, end]

    @property
    def max_model_len(self) -> int:
        """The context length the API reports: --context-length when given (as SGLang and vLLM report it; a
        request must also fit the KV pool), else the scheduler's limit."""
        return self.state.server_args.context_length or self.manager.context_length

    def logprobs_count(self, value: int | None, param: str) -> int | None:
        """A request's number of top logprobs checked against --max-logprobs (a 400 naming `param`), -1 (with
        --max-logprobs -1) meaning the whole vocabulary."""
        error = top_logprobs_error(value, param, self.state.server_args.max_logprobs)
        if error:
            raise bad(error, param)
        return self.manager.vocab_size if value == -1 else value

    def check_model(self, name: str | None, task: str | None = "generate") -> None:
        """A 404 for another model's name; a 400 when the served model does not do `task`: "generate", "embed"
        (an embedding model) or "score" (a cross-encoder's rerank); None: any."""
        if name and name != self.state.model_name:
            raise ApiError(404, f"The model `{name}` does not exist. This server serves `{self.state.model_name}`.",
                           param="model", code="model_not_found")
        served = self.manager.model_info.get("task") or "generate"
        if task is None or task == served:
            return
        model = f"`{self.state.model_name}`"
        if served == "embed":
            raise bad(f"{model} is an embedding model: this server answers POST /v1/embeddings, not "
                      + ("reranking, which needs a cross-encoder (BertForSequenceClassification)." if task == "score"
                         else "generation. Serve a generative model for chat and completions."), "model")
        if served == "score":
            raise bad(f"{model} is a cross-encoder (a reranker): this server answers POST /v1/rerank, which scores "
                      "query-document pairs; it neither embeds nor generates.", "model")
        if task == "embed":
            raise bad(f"{model} is a generative model: this server does not embed. Start an embedding server with "
                      "`servelm serve --model-path <embedding model> --is-embedding` (vLLM: --runner pooling).",
                      "model")
        raise bad(f"{model} is a generative model: classification needs a cross-encoder server (`servelm serve "
                  "--model-path <BertForSequenceClassification folder>`).", "model")

    def check_ids(self, ids: list[int], param: str) -> None:
        error = token_ids_error(ids, self.manager.vocab_size, param)
        if error:
            raise bad(error, param)

    def truncate(self, ids: list[int], keep: int | None, side: str | None = None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the last `keep` tokens of a prompt (the first ones with
        truncation_side "right"); -1 keeps as many as leave room for one generated token in the context.
        Checked here, before the prompt is cut."""
        if keep is None:
            return ids
        if keep < 1 and keep != -1:
            raise bad(f"truncate_prompt_tokens must be at least 1 (or -1: as many as fit the context), got {keep}",
                      "truncate_prompt_tokens")
        keep = max(1, self.manager.context_length - 1) if keep == -1 else keep
        return ids[:keep] if side == "right" else ids[-keep:]

    def token_str(self, token_id: int, as_ids: bool = False) -> str:
        """A token as logprobs show it: its text, or vLLM's `token_id:N` (return_tokens_as_token_ids)."""
        return f"token_id:{token_id}" if as_ids else self.manager.token_text(token_id)

    def vllm_prompt_logprobs(self, prompt: list[int], acc: Accumulated, k: int,
                             as_ids: bool = False) -> list[dict[str, Any] | None]:
        """vLLM's prompt_logprobs: None for the first token, then per token {token id: {logprob, rank,
        decoded_token}} of the token itself and its k most likely alternatives; the token's rank in the whole
        distribution (1 = the most likely), whether or not it is among them."""
        result: list[dict[str, Any] | None] = [None]
        lps, tops = acc.prompt_logprobs or [], acc.prompt_top_logprobs or []
        prompt_ranks = acc.prompt_ranks or []
        for pos in range(1, len(prompt)):
            alternatives = (tops[pos] if pos < len(tops) and tops[pos] else [])[:k]
            ranks = {t: r for r, (t, _) in enumerate(alternatives, 1)}
            entry = {str(prompt[pos]): {"logprob": lps[pos] if pos < len(lps) else None,
                                        "rank": ranks.get(prompt[pos], prompt_ranks[pos]
                                                          if pos < len(prompt_ranks) else None),
                                        "decoded_token": self.token_str(prompt[pos], as_ids)}}
            for t, lp in alternatives:
                entry.setdefault(str(t), {"logprob": lp, "rank": ranks[t], "decoded_token": self.token_str(t, as_ids)})
            result.append(entry)
        return result

    def check_context(self, prompt_len: int, max_new_tokens: int | None, prompt_param: str,
                      limit_param: str) -> None:
        """A 400 when the prompt (with max_new_tokens, when known) does not fit the model's context."""
        error = context_length_error(prompt_len, max_new_tokens, self.manager.context_length, prompt_param,
                                     limit_param, self.manager.model_info.get("model_context_length"))
        if error:
            too_long = max_new_tokens is None or prompt_len >= self.manager.context_length
            raise bad(error, prompt_param if too_long else limit_param)

    def sampling_params(self, req: Any, max_tokens: int | None, max_tokens_param: str, prompt_lens: list[int],
                        prompt_param: str, logprobs: bool, top_logprobs: int,
                        json_schema: str | None = None, schema_param: str = "response_format") -> SamplingParams:
        """SamplingParams of an OpenAI request; `json_schema` (from `schema_param`, e.g. a tool call's) is one
        more constraint besides the request's own (at most one in all)."""
        req.prompt_logprobs = self.logprobs_count(req.prompt_logprobs, "prompt_logprobs")
        check_request_options(req)
        ctx = self.manager.context_length
        longest = max(prompt_lens)
        self.check_context(longest, None, prompt_param, max_tokens_param)
        if max_tokens is None:
            max_tokens = (ctx - longest) if ctx else 16
        kw: dict[str, Any] = {"max_new_tokens": max_tokens, "n": req.n, "seed": req.seed,
                              "ignore_eos": req.ignore_eos, "min_new_tokens": req.min_tokens,
                              "skip_special_tokens": req.skip_special_tokens, "logprobs": logprobs,
                              "top_logprobs": top_logprobs, "stop": req.stop or [],
                              "stop_token_ids": req.stop_token_ids or []}
        for name in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty", "regex", "logit_bias"):
            value = getattr(req, name)
            if value is not None:
                kw[name] = value
        found = constraints_of(req) + ([("json_schema", json_schema, schema_param)] if json_schema is not None else [])
        if len(found) > 1:
            names = ", ".join(name for _, _, name in found)
            raise bad(f"give at most one constraint; got {names}", found[0][2].split(".")[0])
        fields = {"max_tokens": max_tokens_param}
        for kind, value, name in found:
            kw[kind], fields[kind] = value, name
        so = req.structured_outputs
        kw["whitespace_pattern"] = (so and so.whitespace_pattern) or req.guided_whitespace_pattern
        kw["stop_regex"] = req.stop_regex or []
        if req.prompt_logprobs is not None:
            kw["prompt_logprobs"], kw["prompt_top_logprobs"] = True, req.prompt_logprobs
        params = SamplingParams(**kw)
        try:
            params.validate(self.manager.vocab_size)
        except SamplingParamsError as exc:
            param = fields.get(exc.param, exc.param)
            raise bad(str(exc).replace(exc.param, param, 1), param.split(".")[0]) from None
        self.check_context(longest, params.max_new_tokens, prompt_param, max_tokens_param)
        return params

    def submit(self, prompts: list[list[int]], params: SamplingParams, rid: str, stream: bool,
               label_token_ids: list[int] | None = None,
               token_type_ids: list[list[int]] | None = None) -> RequestGroup:
        try:
            return self.manager.submit(prompts, params, rid, stream, label_token_ids, token_type_ids)
        except QueueFullError as exc:
            raise ApiError(429, str(exc), type="rate_limit_exceeded", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from None
        except DuplicateRequestIdError as exc:
            raise bad(str(exc), "rid") from None
        except CapacityError as exc:
            raise bad(str(exc), "n") from None
        except SchedulerUnavailableError as exc:
            raise ApiError(503, str(exc), type="service_unavailable") from None

    async def label_logprobs(self, prompts: list[list[int]], labels: list[int], request: Request,
                             prefix: str) -> list[list[float]] | Any:
        """Prefill-only requests whose final outputs carry the logprobs of `labels` after each prompt (the
        scheduler's scoring rows; /v1/score's label scoring, a decoder reranker's yes/no): each prompt's
        logprobs in label order, or the response of a client that hung up (not a list)."""
        params = SamplingParams(max_new_tokens=0, temperature=0.0)
        group = self.submit(prompts, params, f"{prefix}-{uuid.uuid4().hex}", False, label_token_ids=labels)
        result = await self.run_or_stream(group, request, None)
        if not isinstance(result, list):
            return result
        out = []
        for acc in result:
            logprobs = acc.label_logprobs
            if logprobs is None or len(logprobs) != len(labels):
                raise ApiError(500, f"scoring failed: {acc.finish_reason and acc.finish_reason.to_dict()}",
                               type="internal_error")
            out.append(list(logprobs))
        return out

    async def run_or_stream(self, group: RequestGroup, request: Request, stream_gen: Any) -> Any:
        if stream_gen is not None:
            return StreamingResponse(stream_gen, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            accs = await collect(group, request)
        except ClientGone:
            return Response(status_code=499)
        for acc in accs:
            err = error_of(acc)
            if err is not None:
                raise err
        return accs
