"""The diffusion server: the OpenAI Images API over a diffusers pipeline.

Routes: POST /v1/images/generations (JSON), POST /v1/images/edits (multipart), GET /v1/images/{id}/content
(edits with response_format=url), GET /v1/models, GET /models, /health, /metrics. The error shape, API key,
starting/stopping guard, graceful SIGTERM and logging are http_common's, as for the LLM server. The port
opens at once; /health answers 503 while the pipeline loads in a thread, then 200.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import logging
import random
import signal
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from PIL import Image, UnidentifiedImageError
from pydantic import ValidationError

from servelm import __version__
from servelm.diffusion.config import DiffusionServerArgs
from servelm.diffusion.metrics import DiffusionMetrics
from servelm.diffusion.protocol import (
    ImageData,
    ImageEditRequest,
    ImageGenerationRequest,
    ImagesResponse,
    check_steps,
    parse_size,
)
from servelm.diffusion.runtime import DiffusionRuntime, ImageJob, PipelineLoadError
from servelm.diffusion.scheduler import ImageScheduler, Pending, QueueFull, RequestFailed, stop_task
from servelm.entrypoints.http_common import (
    ApiError,
    GracefulServer,
    GuardMiddleware,
    ServerError,
    ServerLifecycle,
    bad,
    configure_logging,
    health_response,
    install_error_handlers,
    listen_socket,
)
from servelm.entrypoints.openai_protocol import ModelCard, ModelList

logger = logging.getLogger("servelm.diffusion")

MAX_UPLOAD_BYTES = 25 * 1024 * 1024
HANG_UP_POLL_S = 0.1


@dataclass
class DiffusionState(ServerLifecycle):
    args: DiffusionServerArgs
    metrics: DiffusionMetrics
    runtime: DiffusionRuntime | None = None
    scheduler: ImageScheduler | None = None
    images: OrderedDict[str, bytes] = field(default_factory=OrderedDict)  # id -> PNG, least recent first

    @property
    def api_key(self) -> str | None:
        return self.args.api_key

    def store(self, png: bytes) -> str:
        image_id = f"img-{uuid.uuid4().hex}"
        self.images[image_id] = png
        while len(self.images) > self.args.image_store_size:
            self.images.popitem(last=False)
        return image_id


# ------------------------------------------------------------------ requests -> jobs
def _check_model(state: DiffusionState, model: str | None) -> None:
    if model is not None and model not in (state.args.model_name, state.args.model_path):
        raise ApiError(404, f"The model `{model}` does not exist. This server serves `{state.args.model_name}`.",
                       param="model", code="model_not_found")


def build_job(state: DiffusionState, req: ImageGenerationRequest | ImageEditRequest,
              image: Image.Image | None = None) -> ImageJob:
    """The request with the pipeline's defaults filled in; a 400 for what this pipeline cannot do."""
    runtime = state.runtime
    assert runtime is not None
    _check_model(state, req.model)
    default = edit_size(image.size, state.args.max_image_size) if image is not None else runtime.default_size
    width, height = parse_size(req.size, default, state.args.max_image_size)
    steps = check_steps(req.num_inference_steps or runtime.default_steps, state.args.max_inference_steps)
    if req.guidance_scale is not None and runtime.default_guidance is None:
        raise bad(f"guidance_scale: {runtime.info()['pipeline_class']} takes no guidance_scale", "guidance_scale")
    if req.negative_prompt is not None and not runtime.accepts("negative_prompt"):
        raise bad(f"negative_prompt: {runtime.info()['pipeline_class']} takes no negative_prompt", "negative_prompt")
    seed = req.seed if req.seed is not None else random.randrange(2**31)
    guidance = req.guidance_scale if req.guidance_scale is not None else runtime.default_guidance
    job = ImageJob(prompt=req.prompt, n=req.n, width=width, height=height, steps=steps, guidance=guidance,
                   seed=seed, negative_prompt=req.negative_prompt)
    if image is not None:
        strength = req.strength  # type: ignore[union-attr]
        if int(steps * strength) < 1:  # img2img denoises int(steps x strength) steps: none is a pipeline error
            raise bad(f"num_inference_steps ({steps}) x strength ({strength}) must be at least 1 for an edit",
                      "strength")
        job.image = image if image.size == (width, height) else image.resize((width, height), Image.LANCZOS)
        job.strength = strength
    return job


def edit_size(size: tuple[int, int], max_side: int) -> tuple[int, int]:
    """An edit's default output size: the upload's, scaled down to fit `max_side`, in multiples of 8."""
    scale = min(1.0, max_side / max(size))
    return tuple(max(8, int(side * scale) // 8 * 8) for side in size)  # type: ignore[return-value]


async def _read_upload(form: Any) -> Image.Image:
    uploads = [v for k in ("image", "image[]") for v in form.getlist(k)]
    if not uploads:
        raise bad("image: required (a PNG, JPEG or WebP file)", "image")
    if len(uploads) > 1:
        raise bad("image: send one image", "image")
    upload = uploads[0]
    if isinstance(upload, str):
        raise bad("image: must be a file upload, not a text field", "image")
    data = await upload.read(MAX_UPLOAD_BYTES + 1)
    if len(data) > MAX_UPLOAD_BYTES:
        raise bad(f"image: larger than {MAX_UPLOAD_BYTES // (1024 * 1024)} MiB", "image")
    try:
        return await asyncio.to_thread(_decode, data)  # a large upload would hold up the event loop
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError, ValueError):
        raise bad("image: not an image file PIL can read (send a PNG, JPEG or WebP)", "image") from None


def _decode(data: bytes) -> Image.Image:
    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


async def parse_edit(request: Request) -> tuple[ImageEditRequest, Image.Image]:
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise bad("/v1/images/edits takes multipart/form-data (an image file and form fields)", "body")
    form = await request.form()
    if "mask" in form:
        raise bad("mask: inpainting is not supported; send the image alone", "mask")
    fields = {k: v for k, v in form.multi_items() if k not in ("image", "image[]") and isinstance(v, str)}
    try:
        req = ImageEditRequest.model_validate(fields)
    except ValidationError as exc:  # located as a JSON body's fields are, for the same 400 messages
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
    return req, await _read_upload(form)


# ------------------------------------------------------------------ running them
async def run_job(state: DiffusionState, job: ImageJob, request: Request) -> list[bytes]:
    """Queue `job` and wait for its PNGs; a client that hangs up is cancelled at once."""
    scheduler = state.scheduler
    assert scheduler is not None
    try:
        pending = scheduler.submit(job)
    except QueueFull as exc:
        raise ApiError(429, "Too many image requests are waiting; retry later", type="rate_limit_error",
                       code="queue_full", headers={"Retry-After": str(exc.retry_after_s)}) from None
    await _wait(scheduler, pending, request)
    try:
        return pending.future.result()
    except RequestFailed as exc:
        kind = "service_unavailable" if exc.status == 503 else "internal_error"
        raise ApiError(exc.status, str(exc), type=kind) from None


async def _wait(scheduler: ImageScheduler, pending: Pending, request: Request) -> None:
    while not pending.future.done():
        await asyncio.wait({pending.future}, timeout=HANG_UP_POLL_S)
        if not pending.future.done() and await request.is_disconnected():
            logger.info("Client hung up: request cancelled")
            scheduler.cancel(pending)


def images_response(state: DiffusionState, pngs: list[bytes], response_format: str | None,
                    request: Request) -> ImagesResponse:
    if response_format == "url":
        base = str(request.base_url).rstrip("/")
        return ImagesResponse(data=[ImageData(url=f"{base}/v1/images/{state.store(p)}/content") for p in pngs])
    return ImagesResponse(data=[ImageData(b64_json=base64.b64encode(p).decode()) for p in pngs])


def build_app(state: DiffusionState, lifespan: Any = None) -> FastAPI:
    app = FastAPI(title="servelm diffusion", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, state=state)

    @app.post("/v1/images/generations", response_model_exclude_none=True)
    async def generations(req: ImageGenerationRequest, request: Request) -> ImagesResponse:
        pngs = await run_job(state, build_job(state, req), request)
        return images_response(state, pngs, req.response_format, request)

    @app.post("/v1/images/edits", response_model_exclude_none=True)
    async def edits(request: Request) -> ImagesResponse:
        req, image = await parse_edit(request)
        if state.runtime is not None and state.runtime.img2img is None:
            raise bad(f"{state.runtime.info()['pipeline_class']} has no image-to-image variant in diffusers: "
                      "edits are not supported for this model", "image")
        pngs = await run_job(state, build_job(state, req, image), request)
        return images_response(state, pngs, req.response_format, request)

    @app.get("/v1/images/{image_id}/content")
    async def image_content(image_id: str) -> Response:
        png = state.images.get(image_id)
        if png is None:
            raise ApiError(404, f"No image `{image_id}` (unknown, or dropped from the store of the last "
                                f"{state.args.image_store_size})", type="not_found_error", param="image_id")
        state.images.move_to_end(image_id)
        return Response(png, media_type="image/png")

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=state.args.model_name, root=state.args.model_name)])

    @app.get("/models")
    async def model_info() -> dict[str, Any]:
        assert state.runtime is not None
        return state.runtime.info()

    @app.get("/health")
    async def health() -> Response:
        return health_response(state)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


# ------------------------------------------------------------------ lifetime
def _lifespan(state: DiffusionState) -> Any:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        startup = asyncio.create_task(_startup(state))
        try:
            yield
        finally:
            state.shutting_down = True
            await stop_task(startup)
            if state.scheduler is not None:
                state.scheduler.close()

    return lifespan


async def _startup(state: DiffusionState) -> None:
    args, started = state.args, time.monotonic()
    try:
        state.runtime = await asyncio.to_thread(DiffusionRuntime.load, args.model_path, args.device, args.dtype,
                                                args.num_threads)
    except Exception as exc:
        state.fail(str(exc) if isinstance(exc, PipelineLoadError) else f"{type(exc).__name__}: {exc}")
        return
    state.scheduler = ImageScheduler(state.runtime, state.metrics, args.max_batch_size, args.max_queued_requests,
                                     args.batch_wait_ms / 1000)
    state.ready = True
    info = state.runtime.info()
    logger.info("servelm ready in %.1f s: %s (%s), %s on %s, default %s, serving at http://%s:%d",
                time.monotonic() - started, args.model_path, info["pipeline_class"], info["dtype"], info["device"],
                info["default_size"], args.host, args.port)
    await state.scheduler.run_forever()


async def _drain(state: DiffusionState, stop_signal: int | None) -> None:
    """Running and queued requests get --shutdown-timeout seconds (none on Ctrl-C), then a 503."""
    scheduler = state.scheduler
    if scheduler is None:
        return
    grace = 0.0 if stop_signal == signal.SIGINT else state.args.shutdown_timeout
    deadline = time.monotonic() + grace
    while scheduler.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if scheduler.num_in_flight:
        logger.warning("Shutting down: ending %d image request(s) with an error", scheduler.num_in_flight)
        scheduler.fail_all("The server is shutting down")


def launch_server(args: DiffusionServerArgs) -> None:
    """Serve until Ctrl-C/SIGTERM; ServerError when the port cannot be had or the pipeline does not load."""
    configure_logging(args.log_level)
    sock = listen_socket(args.host, args.port)
    state = DiffusionState(args=args, metrics=DiffusionMetrics(args.model_name))
    try:
        config = uvicorn.Config(build_app(state, _lifespan(state)), host=args.host, port=args.port,
                                log_level=args.log_level, timeout_graceful_shutdown=3, timeout_keep_alive=5)
        server = GracefulServer(config, state, drain=lambda sig: _drain(state, sig))
        state.uvicorn_server = server
        logger.info("HTTP port open at http://%s:%d; loading %s (requests get 503 until it is ready)",
                    args.host, args.port, args.model_path)
        server.run(sockets=[sock])
    finally:
        sock.close()
    if state.fatal_error:
        raise ServerError(state.fatal_error)
