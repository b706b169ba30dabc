"""`grace` commands of the index side: synth, train-tokenizer, build-index, validate-index,
builder."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from cli.common import (
    CATALOG_HELP,
    LAST_TOKEN_HELP,
    SCHEMA_HELP,
    SID_SPACE_HELP,
    AddCommand,
    positive_float,
    positive_int,
    share,
    show_progress,
    targeting_schema,
)
from contracts.sid_space import LAST_TOKENS

if TYPE_CHECKING:
    from index_builder.sidecar import SidChoice


_KWAY_HELP = (
    "also build k-way partitioned matchers: 'static' (k per step 64,64,32,8), "
    "'static:K1,K2,K3,K4', 'dynamic' (k_max 32, target fill 0.25) or "
    "'dynamic:KMAX,FILL'. Costly at scale; the paper found no pass-rate gain."
)
_DEVICE_HELP = (
    "torch device computing SIDs from embeddings: 'cpu' (default) or 'cuda' "
    "(paper scale; a near-tie may pick another code than on the CPU)"
)


def _add_workers(p: argparse.ArgumentParser, what: str) -> None:
    help_ = f"{what} (default: every CPU); the output does not depend on it"
    p.add_argument("--workers", type=positive_int, default=None, help=help_)


def _synth(args: argparse.Namespace) -> int:
    """generate a synthetic ads world (catalog, users, held-out interactions)

    Generate a seeded, realistic synthetic ads world: geography, advertisers with targeting
    styles, ads with content embeddings, users with locations and eligible interaction
    histories. Writes catalog.jsonl/.parquet, users.parquet, heldout.parquet and world.json
    into OUT. For paper scale (30 M ads) use `--profile paper --users 1000 --no-jsonl` on
    many cores (docs/PERFORMANCE.md)."""
    from index_builder.parallel import default_workers
    from index_builder.synth import generate_world

    profile = args.profile
    if args.set:
        from index_builder.synth import PROFILES

        profile = PROFILES[args.profile].with_knobs(_knob_settings(args.set))
    summary = generate_world(
        profile,
        args.seed,
        Path(args.out),
        n_ads=args.ads,
        n_users=args.users,
        progress=show_progress(args),
        workers=args.workers or default_workers(),
        jsonl=not args.no_jsonl,
    )
    counts = ", ".join(f"{k} {v}" for k, v in summary.get("counts", {}).items())
    line = f"world written to {args.out} ({counts})"
    print(json.dumps(summary, indent=1, default=str) if args.json else line)
    return 0


def _knob_settings(pairs: list[str]) -> dict[str, str]:
    """`--set KNOB=VALUE` arguments as {knob: text}."""
    settings = {}
    for pair in pairs:
        knob, sep, text = pair.partition("=")
        if not sep or not knob:
            raise ValueError(f"--set takes KNOB=VALUE, got {pair!r}")
        settings[knob.strip()] = text.strip()
    return settings


def _train_tokenizer(args: argparse.Namespace) -> int:
    """train the RQ-KMeans SID tokenizer on a catalog's embeddings

    Train the SID tokenizer (3 residual k-means levels + a last token: by rank in the
    prefix, or a 4th level with --last-token code) on the embeddings of the catalog's ads
    that carry no sid, and save it."""
    from index_builder.catalog import read_catalog
    from index_builder.tokenizer import SIDTokenizer, TokenizerConfig

    progress = show_progress(args)
    catalog = read_catalog(args.catalog, progress=progress, schema=targeting_schema(args))
    if catalog.embedding is None:
        raise SystemExit(f"{args.catalog}: no embeddings to train a SID tokenizer on")
    have = ~catalog.has_sid
    config = TokenizerConfig(
        codebook_size=args.codebook_size,
        iterations=args.iterations,
        train_sample=args.sample,
        seed=args.seed,
        last_token=args.last_token,
    )
    # no copy of the embedding matrix when every ad needs a SID (30 M x 32 at paper scale)
    embeddings = catalog.embedding if have.all() else catalog.embedding[have]
    tok = SIDTokenizer.train(embeddings, config, progress=progress, workers=args.workers)
    tok.save(Path(args.out))
    _, report = tok.assign(embeddings, device=args.device, workers=args.workers)
    print(f"tokenizer {tok.fingerprint} saved to {args.out}; on this catalog: {report.summary()}")
    return 0


def _build_index(args: argparse.Namespace) -> int:
    """build and atomically publish an index version from a catalog

    Read and validate a catalog, assign SIDs (from the catalog or the tokenizer), build the
    GTM trie with deduplicated matchers, the SID->ad index and the exact targeting index,
    and publish them as a new version under OUT (CURRENT is repointed atomically; old
    versions pruned). Bad rows within --bad-row-budget are left out and listed in
    OUT/catalog-rejects.jsonl; past it the build fails naming the first row and field and
    how many are bad, and nothing is published."""
    from index_builder.build import build_index
    from index_builder.kway import KwaySpec

    version, report = build_index(
        args.catalog,
        args.out,
        tokenizer_path=args.tokenizer,
        kway=KwaySpec.parse(args.kway) if args.kway else None,
        keep=args.keep,
        progress=show_progress(args),
        device=args.device,
        workers=args.workers,
        sid_space=args.sid_space,
        schema=targeting_schema(args),
        bad_row_budget=args.bad_row_budget,
    )
    if args.json:
        print(json.dumps({"version": version, **vars(report)}, indent=1))
    else:
        counts = " ".join(f"{k}={v}" for k, v in report.counts.items())
        print(f"published {Path(args.out) / version}\n  {counts}\n  seconds {report.seconds}")
        if report.collisions:
            print(f"  SID collisions: {report.collisions}")
        if report.rejected_rows:
            print(f"  {report.rejected_rows} bad catalog rows left out: "
                  f"{Path(args.out) / 'catalog-rejects.jsonl'}")  # fmt: skip
    return 0


def _validate_index(args: argparse.Namespace) -> int:
    """check an index version completely; non-zero exit on any fault

    Check checksums, dtypes and shapes, CSR trie invariants, the SID->ad and targeting
    indexes, and that every matcher covers its subtree (no false negatives). PATH is a
    version directory or a root with CURRENT."""
    from contracts.index_validation import IndexValidationError, validate_index
    from index_builder.publish import resolve

    path = resolve(Path(args.path))
    try:
        index = validate_index(path, expect_tokenizer=args.expect_tokenizer)
    except IndexValidationError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    m = index.manifest
    counts = " ".join(f"{k}={v}" for k, v in m.get("counts", {}).items())
    print(f"OK {path} (index {m['index_version']}, format {m['format_version']})\n  {counts}")
    return 0


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


def _add_bad_row_budget(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bad-row-budget", type=share, default=0.001, metavar="SHARE",
                   help="bad catalog rows (a broken line, an unknown value, a duplicate id) "
                   "are left out while they are at most this share of the rows (0.001 = "
                   "0.1 %%), each listed in OUT/catalog-rejects.jsonl; past it the build fails "
                   "and publishes nothing; 0: any bad row fails it")  # fmt: skip


def register(add: AddCommand) -> None:
    p = add("synth", _synth)
    p.add_argument("--profile", choices=["tiny", "demo", "study", "paper"], default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--ads", type=int, help="override the profile's number of ads")
    p.add_argument("--users", type=int, help="override the profile's number of users")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="override one knob of the profile (repeatable), e.g. --set fresh_share=0.3 "
        "or --set style_mix=0.15,0.05,0.5,0.3; world.json records every knob (docs/SYNTH.md)",
    )
    p.add_argument(
        "--no-jsonl",
        action="store_true",
        help="write the catalog as Parquet only (JSONL: ~512 bytes and ~4 us per ad)",
    )
    _add_workers(p, "processes drawing ads")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-progress", action="store_true")

    p = add("train-tokenizer", _train_tokenizer)
    p.add_argument("--catalog", required=True, help=CATALOG_HELP)
    p.add_argument("--out", required=True, help="tokenizer directory to write")
    p.add_argument("--targeting-schema", metavar="FILE", help=SCHEMA_HELP)
    p.add_argument("--codebook-size", type=int, default=512)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--sample", type=int, default=200_000, help="embeddings to train on")
    p.add_argument("--last-token", choices=LAST_TOKENS, default="rank", help=LAST_TOKEN_HELP)
    p.add_argument("--seed", type=int, default=0)
    _add_workers(p, "CPU threads for k-means and SIDs")
    p.add_argument("--device", default="cpu", help=_DEVICE_HELP)
    p.add_argument("--no-progress", action="store_true")

    p = add("build-index", _build_index)
    p.add_argument("--catalog", required=True, help=CATALOG_HELP)
    p.add_argument("--tokenizer", help="SID tokenizer (needed when ads lack 'sid')")
    p.add_argument("--sid-space", metavar="NAME", help=SID_SPACE_HELP)
    p.add_argument("--out", required=True, help="index root (holds versions and CURRENT)")
    p.add_argument("--keep", type=int, default=3, help="versions to keep (default 3)")
    p.add_argument("--kway", metavar="SPEC", help=_KWAY_HELP)
    p.add_argument("--targeting-schema", metavar="FILE", help=SCHEMA_HELP)
    _add_workers(p, "CPU threads for SIDs and the build")
    p.add_argument("--device", default="cpu", help=_DEVICE_HELP)
    p.add_argument("--json", action="store_true", help="print the build report as JSON")
    p.add_argument("--no-progress", action="store_true")
    _add_bad_row_budget(p)

    p = add("validate-index", _validate_index)
    p.add_argument("path", metavar="PATH")
    p.add_argument("--expect-tokenizer", metavar="FINGERPRINT", help="refuse other tokenizers")

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
    p.add_argument("--kway", metavar="SPEC", help=_KWAY_HELP)
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
    _add_bad_row_budget(p)
    p.add_argument("--rejects", metavar="FILE",
                   help="where rejected change records go, one JSON line each with its "
                   "seq, field and reason (OUT/deltas/rejects.jsonl)")  # fmt: skip
