"""`grace builder`: the index builder sidecar — rebuilds on catalog or SID-space changes,
publishes a change feed as delta segments, serves its own metrics (index_builder/sidecar.py).
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from cli.common import (
    CATALOG_HELP,
    KWAY_HELP,
    SCHEMA_HELP,
    SID_SPACE_HELP,
    AddCommand,
    add_bad_row_budget,
    positive_float,
    targeting_schema,
)

if TYPE_CHECKING:
    from index_builder.sidecar import SidChoice


def model_sids(model: Path) -> Callable[[], SidChoice | None]:
    """`BuilderConfig.sids` following the model at `model` (a checkpoint directory or a
    model repository's CURRENT version, read afresh at every call): its SID-space key and
    its tokenizer or SID space name; None while there is no model there yet."""
    from cli.bootstrap import sid_source
    from index_builder.sidecar import SidChoice
    from service.model.checkpoint import CONFIG_FILE, sid_space_of
    from service.model.repository import resolve_checkpoint

    def choose() -> SidChoice | None:
        try:
            checkpoint = resolve_checkpoint(model)
        except FileNotFoundError:
            return None  # nothing trained or published yet
        # one version throughout (CURRENT may move meanwhile): its key and its SID source
        key = sid_space_of(checkpoint)
        if key is None:
            raise ValueError(f"{checkpoint / CONFIG_FILE} is unreadable: not a model checkpoint")
        return SidChoice(key=key, **sid_source(checkpoint))

    return choose


def _builder(args: argparse.Namespace) -> int:
    """sidecar: rebuild and publish the index whenever the catalog or the model's SID space changes

    Watch a catalog; when it changed since the CURRENT index was built, build and publish a
    new version. With --model it follows the model the server serves (a checkpoint or a
    model repository's CURRENT): SIDs come from that model's tokenizer or named SID space,
    and publishing a model of another SID space builds and publishes an index for it too, so
    the server swaps both in together; until a model is there it waits. Failed builds
    publish nothing, are logged and are not retried until the catalog or the model's SID
    space changes; SIGTERM stops cleanly. With --changes it also publishes a change feed
    as delta segments over the CURRENT version, a fraction of a second behind the feed."""
    from index_builder.kway import KwaySpec
    from index_builder.postgres_source import is_postgres
    from index_builder.sidecar import BuilderConfig, install_signal_handlers, run_builder

    def _feed(source: str | None) -> Path | str | None:
        return None if source is None else source if is_postgres(source) else Path(source)

    stop = threading.Event()
    install_signal_handlers(stop)
    metrics = None
    if args.metrics_port is not None:
        from index_builder.builder_metrics import BuilderMetrics

        metrics = BuilderMetrics()
        port = metrics.serve(args.metrics_port, args.metrics_host)
        print(f"builder metrics on http://{args.metrics_host}:{port}/metrics", flush=True)
    stats = run_builder(
        BuilderConfig(
            catalog=args.catalog if is_postgres(args.catalog) else Path(args.catalog),
            out=Path(args.out),
            interval=args.interval,
            tokenizer=Path(args.tokenizer) if args.tokenizer else None,
            sid_space=args.sid_space,
            sids=model_sids(Path(args.model)) if args.model else None,
            kway=KwaySpec.parse(args.kway) if args.kway else None,
            keep=args.keep,
            max_builds=1 if args.once else None,
            schema=targeting_schema(args),
            metrics=metrics,
            bad_row_budget=args.bad_row_budget,
            changes=_feed(args.changes),
            rejects=Path(args.rejects) if args.rejects else None,
            changes_interval=args.changes_interval,
        ),
        stop,
    )
    return 0 if not (args.once and stats.builds == 0) else 1


def register(add: AddCommand) -> None:
    p = add("builder", _builder)
    p.add_argument("--catalog", required=True, help=CATALOG_HELP + "; or a PostgreSQL table "
                   "of ads, postgresql://USER@HOST:PORT/DB?table=ads, snapshotted for each "
                   "build (docs/DATA.md \"PostgreSQL\")")  # fmt: skip
    p.add_argument("--out", required=True, help="index root")
    p.add_argument("--interval", type=positive_float, default=60.0, help="seconds (60)")
    sids = p.add_mutually_exclusive_group()
    sids.add_argument(
        "--model",
        metavar="PATH",
        help="follow the model at PATH, a checkpoint or a model repository (what `grace "
        "serve --model` serves): build for its SID space, rebuild when that changes",
    )
    sids.add_argument("--tokenizer", help="fixed SID tokenizer (needed when ads lack 'sid')")
    sids.add_argument("--sid-space", metavar="NAME", help=SID_SPACE_HELP)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--once", action="store_true", help="exit after one successful build")
    p.add_argument("--kway", metavar="SPEC", help=KWAY_HELP)
    p.add_argument("--targeting-schema", metavar="FILE", help=SCHEMA_HELP)
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve the builder's Prometheus metrics on this port (0: any free "
                   "one; default: none): builds, failures by reason, last success "
                   "(docs/ops/monitoring.md)")  # fmt: skip
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address of --metrics-port (127.0.0.1; 0.0.0.0 in a pod)",
    )
    p.add_argument("--changes", metavar="DIR|URL",
                   help="a change feed: a directory of append-only *.jsonl change files, "
                   "read in name order, or the postgresql://…?table=ads table --catalog "
                   "names (docs/DATA.md \"Live changes\", \"PostgreSQL\"); its records are "
                   "published as delta segments under OUT/deltas/<version>/ within "
                   "--changes-interval, whatever a full build takes")  # fmt: skip
    p.add_argument("--changes-interval", type=positive_float, default=0.2, metavar="S",
                   help="seconds between polls of --changes (0.2)")  # fmt: skip
    add_bad_row_budget(p)
    p.add_argument("--rejects", metavar="FILE",
                   help="where rejected change records go, one JSON line each with its "
                   "seq, field and reason (OUT/deltas/rejects.jsonl)")  # fmt: skip
