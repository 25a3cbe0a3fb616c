"""HTTP plumbing that every servelm server reuses (the LLM server today, the diffusion server next).

* The OpenAI error shape `{"error": {"message", "type", "param", "code"}}` (`ApiError`, `error_response`)
  and the exception handlers that turn every failure into it (`install_error_handlers`): a client mistake
  is a 4xx naming the field, a fault of ours a 500 with no traceback sent.
* `GuardMiddleware`: 401 without the API key, 503 while starting or stopping, before any endpoint runs.
* `GracefulServer`: uvicorn that drains running requests on SIGTERM (the server says how) before stopping;
  `listen_socket`: the port, bound before a model loads; `configure_logging`.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import json
import logging
import signal
import socket
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from servelm.entrypoints.openai_protocol import ErrorDetail, ErrorResponse, unknown_fields_message

logger = logging.getLogger("servelm.http_server")

# Paths that answer without an API key and before the server is ready (probes and scrapers).
OPEN_PATHS = frozenset({"/health", "/metrics"})


class ApiError(Exception):
    """An HTTP error in the OpenAI error shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


def error_response(status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSON response `{"error": {"message", "type", "param", "code"}}`."""
    body = ErrorResponse(error=ErrorDetail(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def bad(message: str, param: str | None = None) -> ApiError:
    """A 400 about the request's `param`."""
    return ApiError(400, message, param=param)


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    """The 400 of a body that pydantic refused: unknown fields first (a misspelt field is the likely cause of
    anything else), invalid text and malformed JSON said plainly, else the first error's field path."""
    errors = exc.errors()
    unknown = [str(e["loc"][1]) for e in errors if e.get("type") == "extra_forbidden" and len(e["loc"]) == 2]
    if unknown:
        return error_response(400, unknown_fields_message(unknown), param=unknown[0])
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "invalid_text":  # the whole body was checked: the message has the path
        path = str((first.get("ctx") or {}).get("path", "body"))
        return error_response(400, str(first.get("msg")), param=path.split(".")[0])
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return error_response(400, f"Malformed JSON body: {detail or first.get('msg')}", param="body")
    if not loc:
        msg = "Request body is required" if first.get("type") == "missing" else first.get("msg", "")
        return error_response(400, f"body: {msg} (send a JSON object)", param="body")
    # Union member names (e.g. 'list[int]') are noise for the user: keep the field path.
    path = ".".join(p for p in loc if "[" not in p)
    kind = first.get("type", "")
    # A bound's check is named as vLLM's errors name it (clients match on e.g. greater_than_equal).
    named = f" ({kind})" if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than") else ""
    return error_response(400, f"{path}: {first.get('msg')}{named}", param=loc[0])


# SGLang's routes whose clients read its flat error shape, not OpenAI's nested one.
FLAT_ERROR_PATHS = frozenset({"/v1/score"})


def flat_error(response: JSONResponse) -> JSONResponse:
    """SGLang's flat error body `{"object": "error", "message", "type", "param", "code"}` of an OpenAI-shaped
    error response (type as SGLang names it: BadRequestError for a 400, code the HTTP status)."""
    error = json.loads(bytes(response.body))["error"]
    kind = {400: "BadRequestError", 404: "NotFoundError", 429: "RateLimitError"}.get(response.status_code,
                                                                                    "InternalServerError")
    body = {"object": "error", "message": error["message"], "type": kind, "param": error.get("param"),
            "code": response.status_code}
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
    return JSONResponse(body, status_code=response.status_code, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Every error an endpoint can raise becomes the OpenAI error shape (SGLang's flat one on its routes)."""

    def shaped(request: Request, response: JSONResponse) -> JSONResponse:
        return flat_error(response) if request.url.path in FLAT_ERROR_PATHS else response

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return shaped(request, error_response(exc.status, exc.message, type=exc.type, param=exc.param,
                                              code=exc.code, headers=exc.headers))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return shaped(request, validation_error_response(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), type=kind, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "Internal server error", type="internal_error")


@dataclass(kw_only=True)
class ServerLifecycle:
    """The start/stop flags every server's state keeps, and how a fatal fault stops the server.

    A server's state dataclass derives from it (its own fields stay positional-or-keyword); the guard
    reads `ready`, `shutting_down` and the subclass's `api_key`.
    """

    ready: bool = False
    shutting_down: bool = False
    fatal_error: str | None = None
    uvicorn_server: Any = None

    def fail(self, message: str) -> None:
        """Record a fatal fault, let the server end what depends on it (`on_fail`), and make uvicorn stop."""
        logger.error("%s", message)
        self.fatal_error = self.fatal_error or message
        self.shutting_down = True
        self.on_fail(message)
        if self.uvicorn_server is not None:
            self.uvicorn_server.should_exit = True

    def on_fail(self, message: str) -> None:
        """What else a fatal fault ends in this server (nothing by default)."""


class GuardedState(Protocol):
    """What the guard reads of a server's state."""

    ready: bool
    shutting_down: bool

    @property
    def api_key(self) -> str | None: ...


class GuardMiddleware:
    """Answers 401 (API key) and 503 (starting/stopping) before a request reaches its endpoint.

    A plain ASGI middleware (not BaseHTTPMiddleware) so that client hang-ups still reach streaming responses
    at once. `is_open(path)` names further paths that need neither (e.g. a page's static files).
    """

    def __init__(self, app: Any, state: GuardedState, is_open: Callable[[str], bool] = lambda path: False) -> None:
        self.app = app
        self.state = state
        self.is_open = is_open

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and not self.is_open(scope["path"]):
            error = guard_error(self.state, scope)
            if error is not None:
                await error(scope, receive, send)
                return
        await self.app(scope, receive, send)


def guard_error(state: GuardedState, scope: Any) -> Response | None:
    """The 401/503 a request must get before reaching its endpoint, else None."""
    api_key = state.api_key
    if api_key is not None:
        # Compared as raw bytes: a client sends a non-ASCII key as UTF-8, which no str decoding of the
        # header (latin-1, as HTTP has it) would turn back into the key.
        auth = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                auth = value
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), api_key.encode()):
            return error_response(401, "Invalid or missing API key (send 'Authorization: Bearer <key>')",
                                  code="invalid_api_key")
    if state.shutting_down:
        return error_response(503, "The server is shutting down", type="service_unavailable")
    if not state.ready:
        return error_response(503, "The server is starting; retry when /health answers 200",
                              type="service_unavailable", headers={"Retry-After": "1"})
    return None


def health_response(state: GuardedState) -> Response:
    """/health: 200 when ready, else a 503 that says whether the server is starting or stopping."""
    if state.shutting_down:
        return error_response(503, "The server is shutting down", type="service_unavailable")
    if not state.ready:
        return error_response(503, "The server is starting", type="service_unavailable",
                              headers={"Retry-After": "1"})
    return Response(status_code=200)


# ------------------------------------------------------------------ serving
class ServerError(RuntimeError):
    """The server could not start or stopped on a fault (e.g. the scheduler process failed)."""


class StoppableState(Protocol):
    shutting_down: bool


class GracefulServer(uvicorn.Server):
    """uvicorn that stops gracefully on Ctrl-C/SIGTERM.

    The signal marks the server as stopping at once (the guard answers new requests with 503 while the port
    stays open), then `drain(signal)` runs before uvicorn's own shutdown, which would cancel the running
    handlers mid-request (plain-text 500s, streams cut without [DONE], CancelledError tracebacks). The
    signal is not re-raised afterwards, so the caller returns normally.
    """

    def __init__(self, config: uvicorn.Config, state: StoppableState,
                 drain: Callable[[int | None], Awaitable[None]]) -> None:
        super().__init__(config)
        self.state = state
        self.drain = drain
        self.stop_signal: int | None = None  # the signal that stops the server, if one did

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.state.shutting_down = True
        if self.stop_signal is None:
            self.stop_signal = sig
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        if not self.force_exit:
            await self.drain(self.stop_signal)
        await super().shutdown(sockets)


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port for uvicorn to serve on; ServerError (one line) when it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ServerError(f"Port {port} on {host} is already in use (another server?): stop it or pass "
                              f"another --port") from None
        raise ServerError(f"Cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def configure_logging(level: str) -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("servelm").setLevel(level.upper())
