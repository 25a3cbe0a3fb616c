"""The browser chat page at `/` and, offline, the API docs at `/docs` and `/redoc`.

The page (`static/index.html`, `chat.js`, `chat.css`: plain HTML, JS and CSS shipped in the package,
nothing fetched from a CDN) talks to the server's own OpenAI API: `GET /v1/models`, then streamed
`POST /v1/chat/completions`. It must load without an API key (it asks for the key itself), so the
API-key guard lets `is_open_path` paths through.

FastAPI's own `/docs` and `/redoc` pages load their JS and CSS from a CDN, which an offline machine
cannot reach. When the `fastapi-offline` package (Swagger UI 5 and ReDoc as package data, no
dependency but fastapi) is installed, `mount_chat_page` serves those pages from its local copies
under `/static/docs/` instead; without it they are left as FastAPI makes them.
"""

from __future__ import annotations

import html
import importlib.util
from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI, Request, Response
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent / "static"
STATIC_PREFIX = "/static"
DOCS_ASSETS_PREFIX = f"{STATIC_PREFIX}/docs"
# Paths that must answer without an API key: the page itself, and everything under STATIC_PREFIX.
CHAT_PAGE_PATHS = frozenset({"/"})


def is_open_path(path: str) -> bool:
    """True for what the chat page needs before it has a key: `/` and `/static/...` (public files only)."""
    return path in CHAT_PAGE_PATHS or path.startswith(STATIC_PREFIX + "/")


def offline_docs_dir() -> Path | None:
    """The folder of fastapi-offline's Swagger UI/ReDoc files, or None when that package is not installed."""
    spec = importlib.util.find_spec("fastapi_offline")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "static"
    return folder if (folder / "swagger-ui-bundle.js").is_file() else None


def mount_chat_page(app: FastAPI, not_chat: Callable[[], str | None] = lambda: None) -> None:
    """Register `GET /` (the chat page) and the static files under `/static`; serve the API docs offline.
    `not_chat()`: what a server that cannot chat (an embedding model) says at `/` instead, else None."""

    @app.get("/", include_in_schema=False)
    async def chat_page() -> Response:
        text = not_chat()
        if text is not None:
            return HTMLResponse(f"<!doctype html><title>servelm</title><p>{html.escape(text)}</p>"
                                '<p><a href="/docs">API documentation</a></p>')
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    docs = offline_docs_dir()
    if docs is not None:
        _offline_docs(app, docs)  # before the /static mount: routes match in order
    app.mount(STATIC_PREFIX, StaticFiles(directory=STATIC_DIR), name="static")


def _offline_docs(app: FastAPI, assets: Path) -> None:
    """Replace FastAPI's CDN-backed /docs and /redoc with the same pages over local assets."""
    docs_url, redoc_url, openapi_url = app.docs_url, app.redoc_url, app.openapi_url
    if openapi_url is None:
        return
    oauth2_url = app.swagger_ui_oauth2_redirect_url
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in {docs_url, redoc_url}]
    app.mount(DOCS_ASSETS_PREFIX, StaticFiles(directory=assets), name="docs-assets")

    def urls(request: Request) -> tuple[str, str]:
        root = request.scope.get("root_path", "")
        return f"{root}{DOCS_ASSETS_PREFIX}", f"{root}{openapi_url}"

    if docs_url is not None:
        @app.get(docs_url, include_in_schema=False)
        async def swagger_ui(request: Request) -> HTMLResponse:
            base, spec = urls(request)
            return get_swagger_ui_html(openapi_url=spec, title=f"{app.title} - Swagger UI",
                                       oauth2_redirect_url=oauth2_url, swagger_js_url=f"{base}/swagger-ui-bundle.js",
                                       swagger_css_url=f"{base}/swagger-ui.css",
                                       swagger_favicon_url=f"{base}/favicon.png",
                                       swagger_ui_parameters=app.swagger_ui_parameters)

        if oauth2_url and not any(getattr(r, "path", None) == oauth2_url for r in app.router.routes):
            @app.get(oauth2_url, include_in_schema=False)
            async def swagger_ui_redirect() -> HTMLResponse:
                return get_swagger_ui_oauth2_redirect_html()

    if redoc_url is not None:
        @app.get(redoc_url, include_in_schema=False)
        async def redoc(request: Request) -> HTMLResponse:
            base, spec = urls(request)
            return get_redoc_html(openapi_url=spec, title=f"{app.title} - ReDoc",
                                  redoc_js_url=f"{base}/redoc.standalone.js", redoc_favicon_url=f"{base}/favicon.png",
                                  with_google_fonts=False)
