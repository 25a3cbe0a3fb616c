"""The LLM server's FastAPI app: its state and its routes.

Each route hands its request to the serving object of its kind (`serving_chat`, `serving_completions`,
`serving_native`, all built on `serving_base.OpenAIServing`); the HTTP plumbing any server reuses (the OpenAI
error shape, the API-key and lifecycle guard, /health) is in `http_common`; start-up, uvicorn and the scheduler
process are in `launch`.

Every client mistake is a 4xx in the OpenAI error shape `{"error": {"message", "type", "param", "code"}}`;
503 only while starting or stopping; 429 (with Retry-After) when too many requests are in flight.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from servelm import __version__
from servelm.config import ServerArgs
from servelm.entrypoints.chat_page import is_open_path, mount_chat_page
from servelm.entrypoints.http_common import (
    ApiError,
    GuardMiddleware,
    bad,
    health_response,
    install_error_handlers,
)
from servelm.entrypoints.openai_protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from servelm.entrypoints.responses_protocol import ResponseObject, ResponsesRequest
from servelm.entrypoints.server_state import ServerState  # re-exported: launch builds it
from servelm.entrypoints.serving_chat import ServingChat
from servelm.entrypoints.serving_completions import ServingCompletions
from servelm.entrypoints.serving_embedding import EmbeddingRequest, PoolingRequest, ServingEmbedding
from servelm.entrypoints.serving_native import ServingNative
from servelm.entrypoints.serving_rerank import ClassifyRequest, RerankRequest, ServingRerank
from servelm.entrypoints.serving_responses import ServingResponses
from servelm.entrypoints.serving_score import ScoreRequest, ServingScore
from servelm.managers.tokenizer_manager import SchedulerUnavailableError

logger = logging.getLogger("servelm.http_server")


def served_model_name(server_args: ServerArgs) -> str:
    """The model id the API reports and accepts: --served-model-name, else the model path,
    else the default model's file name without its extension."""
    if server_args.served_model_name:
        return server_args.served_model_name
    if server_args.model_path:
        return server_args.model_path
    try:
        from servelm.model_loader.default_model import default_model_path

        return os.path.splitext(os.path.basename(default_model_path()))[0]
    except Exception:
        return "default"


def _not_chat(state: ServerState) -> str | None:
    """What `/` says on a server whose model does not chat (else None: the chat page)."""
    task = state.manager.model_info.get("task")
    if task == "embed":
        return f"This server serves the embedding model {state.model_name}: POST /v1/embeddings (and /v1/rerank)."
    if task == "score":
        return f"This server serves the cross-encoder {state.model_name}: POST /v1/rerank, /v1/score, /classify."
    return None


# ------------------------------------------------------------- the app
def build_app(state: ServerState, lifespan: Callable[[FastAPI], Any] | None = None) -> FastAPI:
    """The FastAPI app over `state`; `lifespan` (launch's) starts and stops the scheduler link."""
    app = FastAPI(title="servelm", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    # /ping is SageMaker's /health: open to probes, like /health.
    app.add_middleware(GuardMiddleware, state=state, is_open=lambda path: path == "/ping" or is_open_path(path))
    native = ServingNative(state)
    _openai_routes(app, state, ServingChat(state), ServingCompletions(state), ServingResponses(state), native)
    _native_routes(app, native, ServingScore(state))
    embedding = ServingEmbedding(state)

    @app.post("/v1/embeddings")
    async def create_embeddings(req: EmbeddingRequest, request: Request) -> Any:
        return await embedding.create(req, request)

    @app.post("/pooling")
    async def pooling(req: PoolingRequest, request: Request) -> Any:
        return await embedding.pooling(req, request)

    reranking = ServingRerank(state)

    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    @app.post("/rerank")
    async def rerank(req: RerankRequest, request: Request) -> Any:
        return await reranking.rerank(req, request)

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify(req: ClassifyRequest, request: Request) -> Any:
        return await reranking.classify(req, request)

    _operations_routes(app, state, native)
    mount_chat_page(app, lambda: _not_chat(state))
    return app


def _openai_routes(app: FastAPI, state: ServerState, chat: ServingChat, completions: ServingCompletions,
                   responses: ServingResponses, native: ServingNative) -> None:
    """/v1/models, chat, completions, responses and SageMaker's /invocations."""

    def model_card() -> ModelCard:
        # root names the model, never the server's file path; max_model_len is --context-length when given.
        return ModelCard(id=state.model_name, root=state.model_name, max_model_len=native.max_model_len or None,
                         task=state.manager.model_info.get("task") or "generate")

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> ModelCard:
        if model_id != state.model_name:
            raise ApiError(404, f"The model `{model_id}` does not exist.", type="invalid_request_error",
                           param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        return await chat.create(req, request)

    @app.post("/v1/completions")
    async def create_completions(req: CompletionRequest, request: Request) -> Any:
        return await completions.create(req, request)

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, request: Request) -> Any:
        return await responses.create(req, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> ResponseObject:
        return await responses.retrieve(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> ResponseObject:
        return await responses.cancel(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return await responses.delete(response_id)

    @app.post("/invocations")
    async def invocations(request: Request) -> Any:
        """SageMaker's inference route: chat when the body has messages, completions when it has a prompt."""
        try:
            body = await request.json()
        except ValueError as exc:  # malformed JSON or not UTF-8
            raise bad(f"Malformed JSON body: {exc}", "body") from None
        return await invoke(body, request)

    async def invoke(body: Any, request: Request) -> Any:
        if not isinstance(body, dict) or not ({"messages", "prompt"} & set(body)):
            raise bad("/invocations needs a JSON object with messages (chat) or prompt (completions)", "body")
        kind, serve = ((ChatCompletionRequest, chat) if "messages" in body else (CompletionRequest, completions))
        try:
            req = kind.model_validate(body)
        except pydantic.ValidationError as exc:
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
        return await serve.create(req, request)


def _native_routes(app: FastAPI, native: ServingNative, scoring: ServingScore) -> None:
    """SGLang's native API: /generate, /v1/score, tokenize and detokenize."""

    @app.post("/v1/score")
    async def score(req: ScoreRequest, request: Request) -> Any:  # SGLang's ScoreResponse or vLLM's shape
        return await scoring.score(req, request)

    @app.post("/generate")
    async def generate(req: GenerateRequest, request: Request) -> Any:
        return await native.generate(req, request)

    @app.post("/v1/tokenize")
    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        return await native.tokenize(req)

    @app.post("/v1/detokenize")
    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        return await native.detokenize(req)


def _operations_routes(app: FastAPI, state: ServerState, native: ServingNative) -> None:
    """Health, load, version, model and server info, cache flush, abort, metrics."""
    manager = state.manager

    @app.get("/health")
    async def health() -> Response:
        return health_response(state)

    @app.get("/ping")
    async def ping() -> Response:
        return health_response(state)

    @app.get("/load")
    async def load() -> dict[str, int]:
        """vLLM's /load: requests in flight (running or waiting in the scheduler)."""
        return {"server_load": manager.num_in_flight}

    @app.get("/get_load")
    async def get_load() -> list[dict[str, int]]:
        """SGLang's /get_load, which sgl-router's power-of-two policy reads: per data-parallel replica, the
        requests it holds (running and waiting), those waiting, and the KV tokens in use."""
        info = await native.scheduler_call(manager.server_info(timeout=5))
        replicas = info.get("replicas") if isinstance(info.get("replicas"), list) else [{**info, "dp_rank": 0}]
        return [{"dp_rank": int(r.get("dp_rank", 0)),
                 "num_reqs": int(r.get("num_running", 0)) + int(r.get("num_waiting", 0)),
                 "num_waiting_reqs": int(r.get("num_waiting", 0)), "num_tokens": int(r.get("kv_in_use_tokens", 0))}
                for r in replicas if r.get("alive", True) and "error" not in r]

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        return await native.health_generate(request)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return await native.model_info()

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        info = await native.server_info()
        # SGLang's name for the KV capacity in tokens.
        return {**info, "max_total_num_tokens": info.get("kv_total_tokens")}

    @app.post("/flush_cache")
    async def flush_cache() -> Any:
        return await native.flush_cache()

    @app.post("/abort_request")
    async def abort_request(req: AbortRequest) -> dict[str, Any]:
        return await native.abort_request(req)

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.ready and not state.shutting_down:
            with contextlib.suppress(SchedulerUnavailableError):
                state.metrics.update_from_server_info(await manager.server_info(timeout=5))
        return Response(state.metrics.render(), media_type=state.metrics.content_type)
