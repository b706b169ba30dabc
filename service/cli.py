"""`grace`: the one command-line entry point. Each subcommand's --help explains it.

Subcommands import their modules lazily so `grace --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

EXIT_BAD_INPUT = 2


def _synth(args: argparse.Namespace) -> int:
    from index_builder.synth import generate_world

    summary = generate_world(
        args.profile,
        args.seed,
        Path(args.out),
        n_ads=args.ads,
        n_users=args.users,
        progress=not args.no_progress,
    )
    print(json.dumps(summary, indent=1, default=str) if args.json else _world_line(summary, args))
    return 0


def _world_line(summary: dict, args: argparse.Namespace) -> str:
    counts = summary.get("counts", {})
    parts = ", ".join(f"{k} {v}" for k, v in counts.items())
    return f"world written to {args.out} ({parts})"


def _train_tokenizer(args: argparse.Namespace) -> int:
    from index_builder.catalog import read_catalog
    from index_builder.tokenizer import SIDTokenizer, TokenizerConfig

    catalog = read_catalog(args.catalog, progress=not args.no_progress)
    if catalog.embedding is None:
        raise SystemExit(f"{args.catalog}: no embeddings to train a SID tokenizer on")
    have = ~catalog.has_sid
    config = TokenizerConfig(
        codebook_size=args.codebook_size,
        iterations=args.iterations,
        train_sample=args.sample,
        seed=args.seed,
    )
    tok = SIDTokenizer.train(catalog.embedding[have], config, progress=not args.no_progress)
    tok.save(Path(args.out))
    _, report = tok.assign(catalog.embedding[have])
    print(f"tokenizer {tok.fingerprint} saved to {args.out}; on this catalog: {report.summary()}")
    return 0


def _build_index(args: argparse.Namespace) -> int:
    from index_builder.build import build_index
    from index_builder.kway import KwaySpec

    version, report = build_index(
        args.catalog,
        args.out,
        tokenizer_path=args.tokenizer,
        kway=KwaySpec.parse(args.kway) if args.kway else None,
        keep=args.keep,
        progress=not args.no_progress,
    )
    if args.json:
        print(json.dumps({"version": version, **vars(report)}, indent=1))
    else:
        counts = " ".join(f"{k}={v}" for k, v in report.counts.items())
        print(f"published {Path(args.out) / version}\n  {counts}\n  seconds {report.seconds}")
        if report.collisions:
            print(f"  SID collisions: {report.collisions}")
    return 0


def _validate_index(args: argparse.Namespace) -> int:
    from index_builder.publish import resolve
    from index_builder.validate import IndexValidationError, validate_index

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


def _builder(args: argparse.Namespace) -> int:
    from index_builder.kway import KwaySpec
    from index_builder.sidecar import BuilderConfig, install_signal_handlers, run_builder

    stop = threading.Event()
    install_signal_handlers(stop)
    stats = run_builder(
        BuilderConfig(
            catalog=Path(args.catalog),
            out=Path(args.out),
            interval=args.interval,
            tokenizer=Path(args.tokenizer) if args.tokenizer else None,
            kway=KwaySpec.parse(args.kway) if args.kway else None,
            keep=args.keep,
            max_builds=1 if args.once else None,
        ),
        stop,
    )
    return 0 if not (args.once and stats.builds == 0) else 1


def _train(args: argparse.Namespace) -> int:
    from service.training.train import TrainSettings, train

    settings = TrainSettings(
        profile=args.profile,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        eval_users=args.eval_users,
        device=args.device,
    )
    metrics = train(
        Path(args.world),
        Path(args.out),
        settings,
        tokenizer_path=Path(args.tokenizer) if args.tokenizer else None,
        progress=not args.no_progress,
    )
    print(json.dumps(metrics, indent=1))
    return 0


def _eval(args: argparse.Namespace) -> int:
    import numpy as np

    from index_builder.build import with_partitions
    from index_builder.kway import KwaySpec
    from index_builder.lookup import FilterMode
    from index_builder.publish import resolve
    from index_builder.synth import load_world
    from index_builder.validate import validate_index
    from service.decode.retrieve import RetrievalIndex
    from service.model.checkpoint import load_checkpoint
    from service.training.data import Examples
    from service.training.study import run_study

    loaded = load_checkpoint(Path(args.model), args.device)
    index = validate_index(resolve(Path(args.index)), expect_tokenizer=loaded.tokenizer.fingerprint)
    arrays = index.arrays
    world = load_world(Path(args.world))
    lookup = RetrievalIndex.from_arrays(arrays).lookup
    examples = Examples(world, lookup, loaded.config)
    users = np.sort(np.random.default_rng(args.seed).permutation(world.n_users)[: args.users])
    beams = tuple(args.beams) if args.beams else loaded.config.beams
    variants = [("cd_only", arrays, FilterMode.CD_ONLY), ("cd_gtm", arrays, FilterMode.CD_GTM)]
    for spec in filter(None, (args.kway or "").split("+")):
        kway = KwaySpec.parse(spec)
        variants.append(
            (f"{kway.mode}_kway", with_partitions(arrays, kway), FilterMode.CD_GTM_KWAY)
        )
    rows = run_study(loaded.model, examples, variants, users, beams, tuple(args.k),
                     device=args.device, progress=not args.no_progress)  # fmt: skip
    report = {
        "world": str(args.world),
        "index_version": index.manifest["index_version"],
        "model_version": loaded.model_version,
        "beams": list(beams),
        "users": len(users),
        "variants": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    cols = ["bitmask_pass", "bloom_pass", "location_pass", "final_pass", "eligible_ads_per_user"]
    cols += [f"recall@{k}" for k in args.k]
    print(f"{'variant':<16}" + "".join(f"{c:>22}" for c in cols))
    for r in rows:
        print(f"{r['variant']:<16}" + "".join(f"{r[c]:>22.4f}" for c in cols))
    return 0


def _flops(args: argparse.Namespace) -> int:
    from service.model.config import profile
    from service.model.flops import decoder_flops

    report = decoder_flops(profile(args.profile), tuple(args.beams) if args.beams else None)
    print(report.table())
    return 0


def _serve(args: argparse.Namespace) -> int:
    from service.app import run
    from service.bootstrap import ensure_default
    from service.settings import load_settings

    settings = load_settings(
        {
            "config": args.config,
            "port": args.port,
            "metrics_port": args.metrics_port,
            "data_dir": args.data_dir,
            "index_root": args.index_root,
            "model_dir": args.model,
            "device": args.device,
        }
    )
    if args.catalog:
        from index_builder.build import build_index

        if not (Path(settings.model_dir) / "config.json").is_file():
            ensure_default(settings, progress=not args.no_progress)  # the default model
        build_index(args.catalog, settings.index_root,
                    tokenizer_path=Path(settings.model_dir) / "tokenizer",
                    progress=not args.no_progress)  # fmt: skip
    else:
        ensure_default(settings, progress=not args.no_progress)
    run(settings)
    return 0


def _query(args: argparse.Namespace) -> int:
    from service.client import query

    return query(args)


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _add_kway(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kway",
        metavar="SPEC",
        help="also build k-way partitioned matchers: 'static' (k per step 64,64,32,8), "
        "'static:K1,K2,K3,K4', 'dynamic' (k_max 32, target fill 0.25) or "
        "'dynamic:KMAX,FILL'. Costly at scale; the paper found no pass-rate gain.",
    )


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

    p = add(
        "synth",
        _synth,
        "generate a synthetic ads world (catalog, users, held-out interactions)",
        "Generate a seeded, realistic synthetic ads world: geography, advertisers with "
        "targeting styles, ads with content embeddings, users with locations and eligible "
        "interaction histories. Writes catalog.jsonl/.parquet, users.parquet, "
        "heldout.parquet and world.json into OUT.",
    )
    p.add_argument("--profile", choices=["tiny", "demo", "paper"], default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--ads", type=int, help="override the profile's number of ads")
    p.add_argument("--users", type=int, help="override the profile's number of users")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-progress", action="store_true")

    p = add(
        "train-tokenizer",
        _train_tokenizer,
        "train the RQ-KMeans SID tokenizer on a catalog's embeddings",
        "Train the SID tokenizer (3 residual k-means levels + a collision token) on the "
        "embeddings of the catalog's ads that carry no sid, and save it.",
    )
    p.add_argument("--catalog", required=True, help="catalog (.jsonl or .parquet)")
    p.add_argument("--out", required=True, help="tokenizer directory to write")
    p.add_argument("--codebook-size", type=int, default=512)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--sample", type=int, default=200_000, help="embeddings to train on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")

    p = add(
        "build-index",
        _build_index,
        "build and atomically publish an index version from a catalog",
        "Read and validate a catalog, assign SIDs (from the catalog or the tokenizer), "
        "build the GTM trie with deduplicated matchers, the SID->ad index and the exact "
        "targeting index, and publish them as a new version under OUT (CURRENT is "
        "repointed atomically; old versions pruned). Bad input fails naming the row and "
        "field; nothing is published.",
    )
    p.add_argument("--catalog", required=True, help="catalog (.jsonl or .parquet)")
    p.add_argument("--tokenizer", help="SID tokenizer (needed when ads lack 'sid')")
    p.add_argument("--out", required=True, help="index root (holds versions and CURRENT)")
    p.add_argument("--keep", type=int, default=3, help="versions to keep (default 3)")
    _add_kway(p)
    p.add_argument("--json", action="store_true", help="print the build report as JSON")
    p.add_argument("--no-progress", action="store_true")

    p = add(
        "validate-index",
        _validate_index,
        "check an index version completely; non-zero exit on any fault",
        "Check checksums, dtypes and shapes, CSR trie invariants, the SID->ad and "
        "targeting indexes, and that every matcher covers its subtree (no false "
        "negatives). PATH is a version directory or a root with CURRENT.",
    )
    p.add_argument("path", metavar="PATH")
    p.add_argument("--expect-tokenizer", metavar="FINGERPRINT", help="refuse other tokenizers")

    p = add(
        "builder",
        _builder,
        "sidecar: rebuild and publish the index whenever the catalog changes",
        "Watch a catalog; when it changed since the CURRENT index was built, build and "
        "publish a new version. Failed builds publish nothing and are logged; SIGTERM "
        "stops cleanly.",
    )
    p.add_argument("--catalog", required=True)
    p.add_argument("--out", required=True, help="index root")
    p.add_argument("--interval", type=_positive_float, default=60.0, help="seconds (60)")
    p.add_argument("--tokenizer", help="SID tokenizer (needed when ads lack 'sid')")
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--once", action="store_true", help="exit after one successful build")
    _add_kway(p)

    p = add(
        "train",
        _train,
        "train the generative retriever on a synthetic world",
        "Teacher-forced next-SID training on the world's interaction histories, with a "
        "held-out recall@K evaluation against an eligible-popularity baseline at the end. "
        "Trains the SID tokenizer too unless --tokenizer is given. Resumable: rerun the "
        "same command after an interruption.",
    )
    p.add_argument("--world", required=True, help="world directory (grace synth)")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--profile", choices=["tiny", "demo", "paper"], default="tiny")
    p.add_argument("--tokenizer", help="use this SID tokenizer instead of training one")
    p.add_argument("--epochs", type=_positive_float, default=4.0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=_positive_float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-users", type=int, default=400, help="held-out users to evaluate")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--no-progress", action="store_true")

    p = add(
        "eval",
        _eval,
        "GTM effectiveness study: pass rates per filter variant and recall@K",
        "Decode held-out requests of a world with a trained model against an index, for "
        "CD only, CD+GTM and (with --kway) partitioned GTM; report exact ad-level pass "
        "rates (bitmask, Bloom, location, final) overall and bucketed by ads generated, "
        "eligible ads per request and recall@K of the held-out next interaction.",
    )
    p.add_argument("--world", required=True)
    p.add_argument("--index", required=True, help="index root (CURRENT) or version dir")
    p.add_argument("--model", required=True, help="checkpoint directory (grace train)")
    p.add_argument("--users", type=int, default=1000, help="held-out users to evaluate")
    p.add_argument("--kway", default="static+dynamic", help="k-way variants, '+'-separated")
    p.add_argument("--beams", type=int, nargs=4, metavar="M", help="override the schedule")
    p.add_argument("--k", type=int, nargs="+", default=[10, 100, 1000], help="recall cut-offs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", help="also write the report as JSON here")
    p.add_argument("--no-progress", action="store_true")

    p = add(
        "flops",
        _flops,
        "decoder FLOPs per request of a model profile",
        "Count decoder FLOPs per request (a multiply-add is 2) by term and step for a "
        "profile's beam schedule or the one given.",
    )
    p.add_argument("--profile", choices=["tiny", "demo", "paper"], default="paper")
    p.add_argument("--beams", type=int, nargs=4, metavar="M")

    p = add(
        "serve",
        _serve,
        "serve Retrieve over gRPC (embedded demo by default)",
        "Serve grace.v1.AdRetrieval with health and reflection, metrics on their own port. "
        "With no arguments: if the data directory lacks a model or an index, generate the "
        "tiny demo world, train the tiny model and publish its index first (a minute or "
        "two, once), then serve on port 50051. --catalog builds and serves an index for "
        "any catalog with the default (or --model) model. Settings also come from "
        "GRACE_* variables and --config; flags win.",
    )
    p.add_argument("--port", type=int, help="gRPC port (50051)")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (9464)")
    p.add_argument("--data-dir", help="where the default world, model and index live (./data)")
    p.add_argument("--index-root", help="index root to serve (DATA_DIR/index)")
    p.add_argument("--model", help="checkpoint directory (DATA_DIR/model)")
    p.add_argument("--catalog", help="build and serve an index for this catalog")
    p.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--config", help="settings file (.toml, .json, .yaml)")
    p.add_argument("--no-progress", action="store_true")

    p = add(
        "query",
        _query,
        "send one Retrieve and print the ads",
        "Send a Retrieve for a user of a synthetic world (default: the embedded demo's) "
        "or for a RetrieveRequest given as JSON, and print the ads and stats.",
    )
    p.add_argument("--target", default="localhost:50051", help="host:port")
    p.add_argument("--world", default="data/world", help="world to take the user from")
    p.add_argument("--user", type=int, default=0, help="user position in the world")
    p.add_argument("--request-json", help="a RetrieveRequest as JSON (file, or - for stdin)")
    p.add_argument("--max-ads", type=int, default=10)
    p.add_argument("--mode", choices=["cd_gtm", "cd_only"], default="cd_gtm")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from index_builder.publish import PublishError

    try:
        return args.fn(args)
    except (PublishError, OSError, ValueError) as exc:  # bad input: CatalogError, BuildError…
        print(f"grace {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
