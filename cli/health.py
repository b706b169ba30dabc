"""`grace health`: one grpc.health.v1 Check, for container and exec probes: exit 0 when
the server answers SERVING, 1 for anything else, with one line saying which. Imports only
grpc (and service/tls.py: grpc and the standard library), so a probe every few seconds
costs ~0.1 s of CPU, not a torch import.
"""

from __future__ import annotations

import argparse
import os
import sys

from cli.common import AddCommand, add_tls_flags, channel, positive_float

DEFAULT_PORT = 50051


def default_target() -> str:
    """127.0.0.1 and the port the server in this container listens on (GRACE_PORT)."""
    return f"127.0.0.1:{os.environ.get('GRACE_PORT') or DEFAULT_PORT}"


def check(args: argparse.Namespace, target: str) -> tuple[bool, str]:
    """(SERVING?, one-line message) for one Check of `args.service` ('' = the server)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    service = args.service
    what = f"{target} service {service!r}" if service else f"{target} (server)"
    with channel(target, args) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            request = health_pb2.HealthCheckRequest(service=service)
            reply = stub.Check(request, timeout=args.timeout)
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.NOT_FOUND:  # the health servicer's answer for it
                return False, f"{what}: unknown service"
            details = " ".join((exc.details() or "").split())  # one line, always
            return False, f"{what}: {code.name}: {details}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{what}: {status}"


def _health(args: argparse.Namespace) -> int:
    """probe a server's gRPC health; exit 0 only when SERVING

    Send one grpc.health.v1 Check and print the answer on one line. Exit 0 on SERVING; 1 on
    NOT_SERVING (still loading, or draining), an unknown service, nothing listening, or no
    answer within --timeout. For container HEALTHCHECKs and exec probes. A TLS port needs
    --tls-ca (mutual TLS also --tls-cert and --tls-key), or their GRACE_TLS_* variables."""
    ok, message = check(args, args.target or default_target())
    print(message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def register(add: AddCommand) -> None:
    p = add("health", _health)
    p.add_argument(
        "--target",
        help=f"host:port (default 127.0.0.1:$GRACE_PORT, else 127.0.0.1:{DEFAULT_PORT})",
    )
    p.add_argument(
        "--service",
        default="",
        help="service to check: '' (default) is the whole server; grace.v1.AdRetrieval "
        "is the retrieval service",
    )
    p.add_argument(
        "--timeout", type=positive_float, default=3.0, help="seconds to wait for the answer (3)"
    )
    add_tls_flags(p)
