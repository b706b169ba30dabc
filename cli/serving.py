"""`grace serve`: settings, a check of its ports, the embedded demo's bootstrap
(cli/bootstrap.py), then one serving process (service/app.py) or a supervisor of several
(service/workers.py)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from cli.common import CATALOG_HELP, SCHEMA_HELP, AddCommand, show_progress, targeting_schema

if TYPE_CHECKING:
    from service.settings import ServerSettings


def _serve(args: argparse.Namespace) -> int:
    """serve Retrieve over gRPC (embedded demo by default)

    Serve grace.v1.AdRetrieval with health and reflection, metrics on their own port. With
    no arguments: if the data directory lacks a model or an index, generate the tiny demo
    world, train the tiny model and publish its index first (once; the training logs its
    progress and the time left), then serve on 127.0.0.1:50051. --catalog builds and serves
    an index for any catalog with the default (or --model) model. Settings also come from
    GRACE_* variables and --config; flags win."""
    from cli.bootstrap import ensure_default, has_model, sid_source
    from service.errors import StartupError
    from service.grpc_server import raise_fd_limit
    from service.logs import configure_logging
    from service.settings import load_settings

    if args.targeting_schema and not args.catalog:  # an index carries its own schema
        raise StartupError("--targeting-schema is for --catalog: a served index carries "
                           "the schema it was built with")  # fmt: skip
    flags = ("config", "host", "port", "metrics_port", "data_dir", "index_root", "device")
    flags += ("workers", "gpus", "mps", "balance", "log_format", "metrics_host")
    flags += ("tls_cert", "tls_key", "tls_client_ca")
    settings = load_settings({f: getattr(args, f) for f in flags} | {"model_dir": args.model})
    configure_logging(logging.getLogger().getEffectiveLevel(), settings.log_format)
    check_ports(settings)  # a taken port fails now, not after minutes of loading
    if settings.tls_cert is not None:  # and so do TLS files that do not load
        from service.tls import Reloader

        Reloader(settings)
    if settings.mps:  # fail before building anything
        from service.mps import check_mps

        check_mps(settings)
    from service.workers import slots

    placed = slots(settings)  # GPUs the settings name but this host lacks: fail now
    raise_fd_limit(settings)  # before any worker starts: they inherit it
    progress = show_progress(args)
    if args.catalog:
        from index_builder.build import build_index

        if not has_model(Path(settings.model_dir)):
            ensure_default(settings, progress=progress)  # the default model
        sids = sid_source(Path(settings.model_dir))
        build_index(args.catalog, settings.index_root, progress=progress,
                    schema=targeting_schema(args), **sids)  # fmt: skip
    else:
        ensure_default(settings, progress=progress)
    if len(placed) > 1:  # a supervisor of that many single-process servers
        from service.workers import supervise

        return supervise(settings, placed)
    from service.app import run
    from service.workers import worker_settings

    return run(worker_settings(settings, placed[0]))  # e.g. --gpus 1: on cuda:1


def check_ports(settings: ServerSettings) -> None:
    """Raise a one-line StartupError when the gRPC or the (first) metrics port is taken, or
    the host is not this machine's, before anything loads. SO_REUSEADDR as gRPC's own
    listener has it: a port that a stopped server left in TIME_WAIT is free."""
    import errno
    import socket

    from service.errors import StartupError

    ports = ((settings.host, settings.port, "gRPC port", "--port", "--host"),
             (settings.metrics_host, settings.metrics_port, "metrics port", "--metrics-port",
              "--metrics-host"))  # fmt: skip
    for host, port, what, flag, host_flag in ports:
        if port == 0:  # any free port: nothing to check
            continue
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise StartupError(f"{what} {port} on {host} is in use (another grace "
                                   f"serve?): stop that server, or choose another port "
                                   f"with {flag}") from None  # fmt: skip
            raise StartupError(f"cannot listen on {host} port {port}: "
                               f"{exc.strerror or exc} ({host_flag})") from None  # fmt: skip


def register(add: AddCommand) -> None:
    p = add("serve", _serve)
    p.add_argument("--host", help="address the gRPC and metrics ports listen on: 127.0.0.1 "
                   "(this machine only; the default) or 0.0.0.0 (every interface: in a "
                   "container, or for other machines' clients)")  # fmt: skip
    p.add_argument("--port", type=int, help="gRPC port (50051)")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (9464)")
    p.add_argument("--metrics-host", help="address the Prometheus port listens on (--host)")
    p.add_argument("--tls-cert", help="PEM certificate (chain) of the gRPC port: TLS, with "
                   "--tls-key; reloaded when the file changes (plain text)")  # fmt: skip
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="PEM CA certificates that callers' certificates "
                   "must chain to: mutual TLS (off)")  # fmt: skip
    p.add_argument("--data-dir", help="where the default world, model and index live (./data)")
    p.add_argument("--index-root", help="index root to serve (DATA_DIR/index)")
    p.add_argument("--model", help="checkpoint directory, or model repository to follow and "
                   "hot-swap (grace publish-model) (DATA_DIR/model)")  # fmt: skip
    p.add_argument("--catalog", help="build and serve an index for this " + CATALOG_HELP)
    p.add_argument("--targeting-schema", metavar="FILE", help="with --catalog: " + SCHEMA_HELP)
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
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (drawn only on a terminal, with text logs)")  # fmt: skip
