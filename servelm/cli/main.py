"""The `servelm` command: serve, generate, backends, version.

Errors a user can fix are printed as one `Error: <message>` line on stderr
(plus `  caused by: <cause>` lines following the `__cause__` chain) with exit
code 1; the traceback is shown only with SERVELM_DEBUG=1.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from servelm import __version__
from servelm.cli.serve import (
    CliError,
    StrictArgumentParser,
    model_path_from_argv,
    normalise_positional_model,
    reap_child_processes,
    registry_call,
    serve,
)
from servelm.cli.serve_backends import FALLBACK_BACKEND, ServeRequest, default_registry
from servelm.config import HTTP_SERVER_FIELDS, ConfigError, ServerArgs

logger = logging.getLogger("servelm")

USAGE = """\
usage: servelm <command> [arguments...]

commands:
  serve      start a server: servelm serve [MODEL] [--model-type TYPE] [options]
             (servelm serve --help lists the options)
  generate   one-shot offline generation: servelm generate [--model-path MODEL] --prompt TEXT
             (a diffusers folder: images, servelm generate --model-path DIR --help)
  bench      benchmarks: servelm bench KIND --help (one-batch, offline, serving, embeddings, allreduce,
             deterministic, images, quant, detokenize)
  backends   list the serve backends, where they come from and whether they load
  version    print the servelm version
"""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _message(exc: BaseException) -> str:
    # Errors we raise on purpose carry a message written for the user; anything
    # else is a bug or an environment problem, where the type name helps.
    if isinstance(exc, (CliError, ConfigError)):
        return _one_line(str(exc))
    text = _one_line(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def report_error(exc: BaseException) -> None:
    """Print `Error: <message>` and `  caused by:` lines for exc (traceback with SERVELM_DEBUG=1)."""
    shown = exc.original if isinstance(exc, CliError) and exc.original is not None else exc
    if os.environ.get("SERVELM_DEBUG") == "1":
        traceback.print_exception(type(shown), shown, shown.__traceback__, file=sys.stderr)
    text = _one_line(str(shown)) if shown is not exc else _message(exc)
    print(f"Error: {text}", file=sys.stderr)
    cause, seen = shown.__cause__, {id(shown)}
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        print(f"  caused by: {_message(cause)}", file=sys.stderr)
        cause = cause.__cause__


# -------------------------------------------------------------- commands
def cmd_serve(argv: list[str]) -> int:
    serve(argv)
    return 0


def build_generate_parser() -> StrictArgumentParser:
    """`servelm generate`: every ServerArgs flag plus the generation options."""
    parser = StrictArgumentParser(
        prog="servelm generate",
        description="Generate one completion offline and print only its text to stdout.",
    )
    group = parser.add_argument_group("generation")
    group.add_argument("--prompt", required=True, help="The prompt (a user message unless --raw).")
    group.add_argument("--max-new-tokens", type=int, default=128, help="Most tokens to generate (default: 128).")
    group.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature (default: 0, greedy).")
    group.add_argument("--seed", type=int, default=None, help="Sampling seed.")
    group.add_argument("--raw", action="store_true", help="Send the prompt as is, without the chat template.")
    ServerArgs.add_cli_args(parser, hidden=HTTP_SERVER_FIELDS)
    return parser


def one_request_kv_tokens(prompt: str, max_new_tokens: int) -> int:
    """KV pool size for generate's one request: no token is shorter than a byte, so the prompt's UTF-8
    length bounds its tokens; 512 more cover a chat template's own text."""
    return len(prompt.encode("utf-8")) + 512 + max_new_tokens


def cmd_generate(argv: list[str]) -> int:
    argv, positional = normalise_positional_model(argv)
    # The backend first, as `serve --model-type auto` picks it: each parses its own generate options.
    model_path = model_path_from_argv(argv)
    registry = registry_call(default_registry)
    request = ServeRequest(argv=tuple(argv), model_path=model_path, model_path_is_positional=positional)
    name = registry_call(registry.auto_detect, request)
    if name == "diffusion":
        from servelm.backends.diffusion import generate

        return generate(argv)
    if name != FALLBACK_BACKEND:
        raise CliError(f"Generate subcommand is not yet supported for model: {model_path}")
    ns = build_generate_parser().parse_args(argv)
    server_args = ServerArgs.from_namespace(ns)
    if server_args.max_total_tokens is None:  # one request: no pool sized for a server's many
        server_args = server_args.replace(max_total_tokens=one_request_kv_tokens(ns.prompt, ns.max_new_tokens))
    if server_args.model_path is not None:
        from servelm.backends.llm import check_model_path_or_exit

        check_model_path_or_exit(server_args.model_path)

    # Imported here: the engine pulls in torch, which nothing else in the CLI needs.
    from servelm.entrypoints.engine import Engine

    with reap_child_processes():
        engine = Engine(server_args)
        try:
            if ns.raw:
                prompt = ns.prompt
            else:
                prompt = engine.tokenizer.apply_chat_template(
                    [{"role": "user", "content": ns.prompt}], tokenize=False, add_generation_prompt=True
                )
            out = engine.generate(
                prompt, {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature, "seed": ns.seed}
            )
            print(out["text"], flush=True)
        finally:
            engine.shutdown()
    return 0


def cmd_backends(argv: list[str]) -> int:
    """Load every backend and print a table. Exits 0 even when some fail to load.

    It is a diagnostic: its job is to show the failures (in the STATUS column,
    with a count on stderr), and `servelm serve` with a healthy backend still
    works while another plugin is broken.
    """
    if argv:
        if argv[0] in ("-h", "--help"):
            print("usage: servelm backends\n\nLoad every serve backend and show provider, API version, "
                  "whether it has a detector, whether it loads and what it serves.")
            return 0
        raise CliError(f"servelm backends: unrecognized arguments: {' '.join(argv)}")
    registry = registry_call(default_registry)
    rows = [("NAME", "PROVIDER", "API", "DETECTOR", "STATUS")]
    failed: list[str] = []
    for name in registry.available_names():
        provider = registry.provider(name)
        try:
            backend = registry.get(name)
        except Exception as exc:
            failed.append(name)
            rows.append((name, provider, "-", "-", f"error: {_one_line(str(exc))}"))
            continue
        summary = getattr(backend, "summary", "")
        rows.append((name, provider, str(backend.api_version), "yes" if backend.detect else "no",
                     f"ok: {summary}" if summary else "ok"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join([*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[-1]]).rstrip())
    if failed:
        print(f"{len(failed)} serve backend(s) failed to load: {', '.join(failed)}", file=sys.stderr)
    return 0


def cmd_bench(argv: list[str]) -> int:
    from servelm.bench import main as bench_main

    return bench_main(argv)


def cmd_version(argv: list[str]) -> int:
    print(__version__)
    return 0


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "serve": cmd_serve,
    "generate": cmd_generate,
    "backends": cmd_backends,
    "bench": cmd_bench,
    "version": cmd_version,
}


def _configure_logging() -> None:
    # Logs go to stderr so that stdout carries only results (generated text, tables, help).
    level = os.environ.get("SERVELM_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `servelm` console script; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(USAGE, end="", file=sys.stderr)
        return 1
    if args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    if args[0] in ("-V", "--version"):
        return cmd_version([])
    command = COMMANDS.get(args[0])
    try:
        if command is None:
            close = difflib.get_close_matches(args[0], list(COMMANDS), n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise CliError(f"Unknown command '{args[0]}'.{hint} Available commands: {', '.join(COMMANDS)}.")
        _configure_logging()
        return command(args[1:])
    except KeyboardInterrupt:
        print("Interrupted.", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout went away (`servelm serve --help | head`): nothing left to tell anyone.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except SystemExit as exc:
        return _exit_code(exc.code)
    except Exception as exc:
        report_error(exc)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
