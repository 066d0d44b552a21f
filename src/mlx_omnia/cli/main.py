"""`omnia`: chat with, run and manage models served by omnia-server."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from mlx_omnia.cli.client import (
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    Client,
    CliError,
)

EPILOG = """\
commands talk to omnia-server over HTTP. When nothing answers on the default URL
(http://127.0.0.1:8642) omnia starts omnia-server in the background (see `omnia status`,
`omnia stop`); another --url is never started.

exit codes:
  0    success
  1    the server answered with an error (unknown model, bad request, failed download...)
  2    usage error (bad options, no prompt)
  3    cannot reach the server (and it was not started automatically)
  130  interrupted (Ctrl-C)

environment: OMNIA_URL (--url), OMNIA_API_KEY (--api-key)."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlx-omnia")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    from mlx_omnia.cli.daemon import default_url

    default = os.environ.get("OMNIA_URL") or default_url()
    # Global options are accepted before or after the command.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url", default=argparse.SUPPRESS, help=f"server URL (env OMNIA_URL; default {default})"
    )
    common.add_argument(
        "--api-key", default=argparse.SUPPRESS, help="the server's API key (env OMNIA_API_KEY)"
    )

    parser = argparse.ArgumentParser(
        prog="omnia",
        description="Chat with, run and manage models served by omnia-server.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"omnia {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def generation(p: argparse.ArgumentParser) -> None:
        p.add_argument("-m", "--model", default=None, help="model id (default: the server's)")
        p.add_argument("-s", "--system", default=None, help="a system message")
        p.add_argument("--max-tokens", type=int, default=None, help="answer at most N tokens")
        p.add_argument("--temperature", type=float, default=None, help="0 = greedy")
        p.add_argument("--seed", type=int, default=None)

    p = sub.add_parser(
        "chat", parents=[common], help="chat in the terminal (streaming, Markdown, history)"
    )
    generation(p)
    p.set_defaults(handler="chat")

    p = sub.add_parser(
        "run",
        parents=[common],
        help="one answer to stdout (prompt argument and/or stdin)",
        description="Stream one answer to stdout: only the model's text goes there, everything "
        'else to stderr. With a prompt and piped stdin the message is "PROMPT\\n\\nSTDIN".',
    )
    p.add_argument("prompt", nargs="?", default=None, help="the message (default: stdin)")
    generation(p)
    p.set_defaults(handler="run")

    models = sub.add_parser("models", parents=[common], help="list, load, unload, remove models")
    models.add_argument("--json", action="store_true", help="list as JSON")
    models.set_defaults(handler="models_list")
    msub = models.add_subparsers(dest="models_command", metavar="ACTION")
    p = msub.add_parser(
        "list", aliases=["ls"], parents=[common], help="models on disk and in memory"
    )
    p.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="print the server's JSON"
    )
    p.set_defaults(handler="models_list")
    p = msub.add_parser("rm", parents=[common], help="delete a downloaded model from disk")
    p.add_argument("id")
    p.set_defaults(handler="models_rm")
    p = msub.add_parser("load", parents=[common], help="load a model into memory")
    p.add_argument("id")
    p.set_defaults(handler="models_load")
    p = msub.add_parser("unload", parents=[common], help="free a model's memory")
    p.add_argument("id")
    p.set_defaults(handler="models_unload")

    p = sub.add_parser("pull", parents=[common], help="download a model from the hub")
    p.add_argument("repo", help="owner/name")
    p.add_argument("--revision", default=None, help="branch, tag or commit")
    p.set_defaults(handler="pull")

    p = sub.add_parser("status", parents=[common], help="the server: pid, uptime, memory, models")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="status")

    p = sub.add_parser("stop", parents=[common], help="stop a server that omnia started")
    p.set_defaults(handler="stop")
    return parser


def _handlers() -> dict[str, Callable[[Any, Any], int]]:
    from mlx_omnia.cli import chat, commands

    return {
        "chat": chat.repl,
        "run": commands.run,
        "models_list": commands.models_list,
        "models_rm": commands.models_rm,
        "models_load": commands.models_load,
        "models_unload": commands.models_unload,
        "pull": commands.pull,
        "status": commands.status,
        "stop": commands.stop,
    }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE

    from rich.console import Console

    from mlx_omnia.cli.commands import Context
    from mlx_omnia.cli.daemon import default_url

    url: str = getattr(args, "url", None) or os.environ.get("OMNIA_URL") or default_url()
    api_key: str | None = getattr(args, "api_key", None) or os.environ.get("OMNIA_API_KEY") or None
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    client = Client(url, api_key)
    ctx = Context(url=client.url, api_key=api_key, client=client, err=err)
    try:
        return _handlers()[args.handler](ctx, args)
    except CliError as e:
        err.print(f"error: {e.message}", style="red", markup=False)
        return e.exit_code
    except KeyboardInterrupt:
        err.print("interrupted", style="dim")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`omnia run ... | head -1`): stop quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
