"""`grace` commands of the index side: synth, train-tokenizer, build-index, validate-index
(the builder sidecar: `cli/builder.py`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cli.common import (
    CATALOG_HELP,
    KWAY_HELP,
    LAST_TOKEN_HELP,
    SCHEMA_HELP,
    SID_SPACE_HELP,
    AddCommand,
    add_bad_row_budget,
    positive_int,
    show_progress,
    targeting_schema,
)
from contracts.sid_space import LAST_TOKENS

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
    p.add_argument("--kway", metavar="SPEC", help=KWAY_HELP)
    p.add_argument("--targeting-schema", metavar="FILE", help=SCHEMA_HELP)
    _add_workers(p, "CPU threads for SIDs and the build")
    p.add_argument("--device", default="cpu", help=_DEVICE_HELP)
    p.add_argument("--json", action="store_true", help="print the build report as JSON")
    p.add_argument("--no-progress", action="store_true")
    add_bad_row_budget(p)

    p = add("validate-index", _validate_index)
    p.add_argument("path", metavar="PATH")
    p.add_argument("--expect-tokenizer", metavar="FINGERPRINT", help="refuse other tokenizers")
