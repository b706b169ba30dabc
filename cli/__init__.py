"""`grace`: the one command-line entry point. Each subcommand's --help explains it.

The commands live by area — `index.py` (synth, train-tokenizer, build-index,
validate-index, builder), `model.py` (train, init-model, eval, publish-model, flops),
`serving.py` (serve, query) — and import their modules lazily so `grace --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from cli import health, index, model, record, serving
from cli.common import EXIT_BAD_INPUT


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grace",
        description="GRACE serving: generative ads retrieval with in-decoding target matching.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help_: str, desc: str):
        p = sub.add_parser(name, help=help_, description=desc)
        p.set_defaults(fn=fn)
        return p

    for area in (index, model, serving, health, record):
        area.register(add)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from index_builder.publish import PublishError
    from service.errors import StartupError

    try:
        return args.fn(args)
    except (PublishError, StartupError, OSError, ValueError) as exc:  # CatalogError, BuildError…
        print(f"grace {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
