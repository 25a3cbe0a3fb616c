"""The built-in `llm` serve backend: the OpenAI-compatible HTTP server.

It is the fallback of `--model-type auto`, so it has no detector, and it needs
no model path: without one it serves the embedded default model.
"""

from __future__ import annotations

import logging

from servelm.cli.serve_backends import (
    SERVE_BACKEND_API_VERSION,
    CliError,
    ServeBackend,
    ServeRequest,
    StrictArgumentParser,
    wants_help,
)
from servelm.config import ServerArgs
from servelm.cpu_threads import configure_cpu_threads, describe_threads

logger = logging.getLogger(__name__)

PROG = "servelm serve"


def build_parser() -> StrictArgumentParser:
    """The `servelm serve` parser of the llm backend: one flag per ServerArgs field."""
    parser = StrictArgumentParser(
        prog=PROG,
        description="llm backend: serve a language model over an OpenAI-compatible HTTP API (an embedding model: "
                    "/v1/embeddings; a cross-encoder: /v1/rerank).",
    )
    ServerArgs.add_cli_args(parser)
    return parser


def check_model_path_or_exit(model_path: str) -> None:
    """Fail at once, in one line, on a path that cannot be a model: before any process or torch starts."""
    from servelm.model_loader.model_path import ModelSourceError, check_model_path

    try:
        check_model_path(model_path)
    except ModelSourceError as exc:
        raise CliError(str(exc), original=exc) from None


def run(request: ServeRequest) -> None:
    """Parse `request.argv`; print help, or launch the HTTP server and block until it stops."""
    parser = build_parser()
    if wants_help(request.argv):
        parser.print_help()
        return
    server_args = ServerArgs.from_namespace(parser.parse_args(list(request.argv)))
    if server_args.model_path is not None:  # (without one, the model runner logs the default model's path)
        check_model_path_or_exit(server_args.model_path)
    # Before the scheduler and TP worker processes are spawned: they inherit the environment.
    threads = configure_cpu_threads(server_args.num_threads,
                                    processes=server_args.tp_ranks_per_node)
    logger.info("Model processes use %s", describe_threads(threads))
    # Imported here so that help, detection and `servelm backends` never pull in the runtime.
    from servelm.entrypoints.launch import ServerError, launch_server

    try:
        launch_server(server_args)
    except ServerError as exc:  # its message is written for the user: no type name in the Error line
        raise CliError(str(exc), original=exc) from None


def create_backend() -> ServeBackend:
    """Factory of the built-in `llm` backend."""
    return ServeBackend(
        api_version=SERVE_BACKEND_API_VERSION,
        run=run,
        detect=None,
        requires_model_path=False,
        summary="language models (HF folder or GGUF) over the OpenAI API, with a chat page; embedding models "
                "(/v1/embeddings) and cross-encoders (/v1/rerank)",
    )
