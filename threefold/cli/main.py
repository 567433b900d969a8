"""Entry point of the `threefold` command.

Exit status: 0 success, 1 a check that ran and failed, 2 bad input (one-line reason on
stderr, no traceback). Each subcommand lives in its own module and registers itself.
"""
from __future__ import annotations

import argparse
import importlib
from importlib.metadata import version
import os
import sys

import torch


from threefold.errors import PlanError, Terminated

# Subcommand modules, in the order `--help` lists them.
COMMANDS = ["inspect", "compile", "check", "schedule", "train", "plan", "run", "export", "generate", "ops"]

# The docs page each command's `--help` ends with (docs/, built with `mkdocs build`); a
# command not named here links to its entry in the generated CLI reference.
DOCS = {
    None: "docs/index.md",
    "inspect": "docs/guides/inspect.md",
    "compile": "docs/guides/artifacts.md",
    "run": "docs/guides/artifacts.md",
    "check": "docs/getting-started.md",
    "schedule": "docs/concepts/schedules.md",
    "train": "docs/guides/data.md",
    "plan": "docs/guides/choosing-a-plan.md",
    "export": "docs/guides/checkpoints.md",
    "generate": "docs/guides/checkpoints.md",
}


def docs_epilog(command: str | None) -> str:
    page = DOCS.get(command)
    ref = f"docs/reference/cli.md#threefold-{command}" if command else "docs/reference/cli.md"
    return f"docs: {page}, reference: {ref}" if page else f"docs: {ref}"


class _Parser(argparse.ArgumentParser):
    """argparse that exits with status 2 and one line, like every other bad input."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _version() -> str:
    """threefold's version, with torch's (the compiler's output depends on both)."""
    from threefold import __version__
    try:
        torch_version = version("torch")
    except Exception:   # not installed as a distribution: ask the module
        torch_version = torch.__version__
    return f"threefold {__version__} (torch {torch_version})"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="threefold",
        description="Compile an unmodified PyTorch model into per-rank programs (tensor, "
        "pipeline, data with ZeRO/HSDP, context and expert parallelism), inspect them, and "
        "train with them.",
        epilog=docs_epilog(None),
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"threefold.cli.{name}_cmd")
        except ModuleNotFoundError as exc:
            if exc.name == f"threefold.cli.{name}_cmd":
                continue  # command not built yet
            raise
        module.register(sub)
    for name, command in sub.choices.items():     # every command's --help ends with its docs
        own = f"{command.epilog}\n\n" if command.epilog else ""
        command.epilog = own + docs_epilog(name)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        # lazy: start-up: a command loads env_check only when it runs
        from threefold.env_check import check_env
        check_env()     # every THREEFOLD_* value: a bad one fails here, not on the ranks after start-up
        return int(args.func(args) or 0)
    except PlanError as exc:
        text = " ".join(str(exc).split())   # always one line, whatever the message held
        print(f"threefold {args.command}: error: {text}", file=sys.stderr)
        return 2
    except Terminated as exc:
        print(f"threefold {args.command}: {exc}", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `threefold ... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
