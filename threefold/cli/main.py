"""Entry point of the `threefold` command.

Exit status: 0 success, 1 a check that ran and failed, 2 bad input (one-line reason on
stderr, no traceback). Each subcommand lives in its own module and registers itself.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from threefold.errors import PlanError, Terminated

# Subcommand modules, in the order `--help` lists them.
COMMANDS = ["inspect", "compile", "check", "schedule", "train", "plan", "run", "export", "generate"]


class _Parser(argparse.ArgumentParser):
    """argparse that exits with status 2 and one line, like every other bad input."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _version() -> str:
    """threefold's version, with torch's (the compiler's output depends on both)."""
    from threefold import __version__
    try:
        from importlib.metadata import version
        torch_version = version("torch")
    except Exception:   # not installed as a distribution: ask the module
        import torch
        torch_version = torch.__version__
    return f"threefold {__version__} (torch {torch_version})"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="threefold",
        description="Compile an unmodified PyTorch model into tensor-, pipeline- and "
        "data-parallel per-rank programs, inspect them, and train with them.",
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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        if "THREEFOLD_TIMEOUT" in os.environ:    # a bad value fails here, not in the launcher after work
            from threefold.runtime.comm import default_timeout
            default_timeout()
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
