"""`grace`: the one command-line entry point. Each subcommand's --help explains it: the
docstring of the function it runs. The commands live by area — `index.py` (synth,
train-tokenizer, build-index, validate-index, builder), `model.py` (train, init-model,
publish-model, flops), `evaluate.py` (eval), `serving.py` (serve), `query.py`,
`health.py`, `record.py` — and import their modules lazily so `grace --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

from cli import builder, evaluate, health, index, model, query, record, serving
from cli.common import EXIT_BAD_INPUT


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grace",
        description="GRACE serving: generative ads retrieval with in-decoding target matching.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="the package version (and git describe in a checkout)")  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        # the command list shows the first line of fn's docstring, `grace NAME --help` the rest
        help_, _, desc = (fn.__doc__ or "").partition("\n")
        p = sub.add_parser(name, help=help_, description=desc)
        p.set_defaults(fn=fn)
        return p

    for area in (index, builder, model, evaluate, serving, query, health, record):
        area.register(add)
    return parser


class _Version(argparse.Action):
    """--version, worked out only when asked (git describe is a subprocess)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version())
        parser.exit()


def version() -> str:
    """`grace-serving X.Y.Z`, plus `git describe` when run from a git checkout."""
    import subprocess
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed
    from pathlib import Path

    try:
        text = f"grace-serving {installed('grace-serving')}"
    except PackageNotFoundError:
        text = "grace-serving (not installed)"
    root = Path(__file__).resolve().parents[1]
    if (root / ".git").exists():
        try:
            cmd = ["git", "describe", "--always", "--dirty"]
            done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=5,
                                  check=False)  # fmt: skip
        except OSError:
            return text
        if done.returncode == 0 and done.stdout.strip():
            text += f" ({done.stdout.strip()})"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from service.logs import LOG_FORMATS, configure_logging

    # `grace serve` sets it again from its settings (a config file may name it too)
    fmt = os.environ.get("GRACE_LOG_FORMAT", "text")
    configure_logging(logging.DEBUG if args.verbose else logging.INFO,
                      fmt if fmt in LOG_FORMATS else "text")  # fmt: skip
    from index_builder.publish import PublishError
    from service.errors import StartupError

    try:
        return args.fn(args)
    except BrokenPipeError:  # `grace query | head`: the reader has gone; nothing to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's exit flush would fail again
        return 0
    except (PublishError, StartupError, OSError, ValueError) as exc:  # CatalogError, BuildError…
        print(f"grace {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
