"""`grace` commands of the service: serve, query."""

from __future__ import annotations

import argparse
from pathlib import Path

from cli.common import CATALOG_HELP, AddCommand


def _serve(args: argparse.Namespace) -> int:
    from cli.bootstrap import ensure_default, has_model, sid_source
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
            "workers": args.workers,
            "gpus": args.gpus,
            "mps": args.mps,
            "balance": args.balance,
            "log_format": args.log_format,
        }
    )
    import logging

    from service.logs import configure_logging

    configure_logging(logging.getLogger().getEffectiveLevel(), settings.log_format)
    if settings.mps:  # fail before building anything
        from service.mps import check_mps

        check_mps(settings)
    from service.workers import slots

    placed = slots(settings)  # GPUs the settings name but this host lacks: fail now
    if args.catalog:
        from index_builder.build import build_index

        if not has_model(Path(settings.model_dir)):
            ensure_default(settings, progress=not args.no_progress)  # the default model
        build_index(args.catalog, settings.index_root, progress=not args.no_progress,
                    **sid_source(Path(settings.model_dir)))  # fmt: skip
    else:
        ensure_default(settings, progress=not args.no_progress)
    if len(placed) > 1:  # a supervisor of that many single-process servers
        from service.workers import supervise

        return supervise(settings, placed)
    from service.app import run
    from service.workers import worker_settings

    return run(worker_settings(settings, placed[0]))  # e.g. --gpus 1: on cuda:1


def _query(args: argparse.Namespace) -> int:
    from service.client import query

    return query(args)


def register(add: AddCommand) -> None:
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
    p.add_argument("--model", help="checkpoint directory, or model repository to follow and "
                   "hot-swap (grace publish-model) (DATA_DIR/model)")  # fmt: skip
    p.add_argument("--catalog", help="build and serve an index for this " + CATALOG_HELP)
    p.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--workers", type=int,
                   help="serving processes per GPU (on a CPU: in all) sharing the port, each "
                   "with its own model, index and GIL; worker i has metrics on "
                   "METRICS_PORT + i (1)")  # fmt: skip
    p.add_argument("--gpus", metavar="LIST",
                   help="which visible GPUs get --workers workers each, e.g. 0,1 (default: "
                   "every visible GPU with --device cuda or auto; each worker then sees "
                   "only its own)")  # fmt: skip
    p.add_argument("--balance", choices=["connection", "request"],
                   help="workers > 1: 'connection' shares the port (SO_REUSEPORT: requests "
                   "follow their connection's worker); 'request' puts a front on the port "
                   "that hands each request to the least busy worker (connection)")  # fmt: skip
    p.add_argument("--mps", action=argparse.BooleanOptionalAction, default=None,
                   help="workers > 1 on CUDA: share the GPU through a private CUDA MPS "
                   "daemon (kernels side by side, not time-sliced). Default: on whenever "
                   "the driver's nvidia-cuda-mps-control is on PATH and no MPS daemon is "
                   "configured already; --mps: required; --no-mps: off")  # fmt: skip
    p.add_argument("--config", help="settings file (.toml, .json, .yaml)")
    p.add_argument("--log-format", choices=["text", "json"],
                   help="log lines as text (default) or one JSON object each")  # fmt: skip
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
    who = p.add_mutually_exclusive_group()
    who.add_argument("--user", type=int, default=0, help="user position in the world (0)")
    who.add_argument("--user-id", type=int, help="the user with this id (what query prints)")
    p.add_argument("--request-json", help="a RetrieveRequest as JSON (file, or - for stdin)")
    p.add_argument("--max-ads", type=int, default=10)
    p.add_argument("--mode", choices=["cd_gtm", "cd_only"], default="cd_gtm")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds")
