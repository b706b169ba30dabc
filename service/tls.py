"""TLS and mutual TLS on the serving port (docs/ops/security.md), both ends of it:

    settings tls_cert, tls_key, tls_client_ca ─► server_credentials ─► grpc_server.bind
    --tls-ca/--tls-cert/--tls-key (grace query, grace health, loadtest) ─► channel

The server's credentials are grpc's dynamic ones: before each TLS handshake grpc asks
`Reloader`, which answers from a stat of the files — None while they are unchanged, the
new configuration once they change and load — so a rotated certificate serves new
connections without a restart (open ones keep theirs). Files that do not load (half
written, a key of another certificate) are logged once and the previous ones serve on.
Imports only grpc, the standard library and service/errors.py: `grace health` uses it on
every probe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from service.errors import StartupError

if TYPE_CHECKING:
    from service.settings import ServerSettings

log = logging.getLogger("grace.tls")
FLAGS = {"tls_cert": "--tls-cert", "tls_key": "--tls-key", "tls_client_ca": "--tls-client-ca"}
# a client's TLS from the environment (flags win): in the server's own container the
# server's pair, so `grace health` there presents it under mutual TLS
CLIENT_ENV = {"ca": "GRACE_TLS_CA", "cert": "GRACE_TLS_CERT", "key": "GRACE_TLS_KEY",
              "server_name": "GRACE_TLS_SERVER_NAME"}  # fmt: skip


class Reloader:
    """The server's certificate configuration, read again when a file changes (its inode,
    size or mtime): the fetcher of grpc's dynamic server credentials, called before each
    handshake on grpc's threads. Raises StartupError when the files do not load at first."""

    def __init__(self, settings: ServerSettings) -> None:
        self.paths: dict[str, Path] = {
            f: getattr(settings, f) for f in FLAGS if getattr(settings, f) is not None
        }
        self._lock = threading.Lock()
        self._unread: tuple[tuple[int, int, int] | None, ...] | None = None  # warned of
        self._seen = self._stamp()
        self.config = self._load()

    def _stamp(self) -> tuple[tuple[int, int, int] | None, ...]:
        stamps = []
        for path in self.paths.values():
            try:
                st = path.stat()
                stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                stamps.append(None)  # mid-rotation: retried once it is back
        return tuple(stamps)

    def _load(self) -> grpc.ServerCertificateConfiguration:
        pem = {field: _read(path, field) for field, path in self.paths.items()}
        _check(pem, self.paths)
        pair = [(pem["tls_key"], pem["tls_cert"])]
        return grpc.ssl_server_certificate_configuration(pair, pem.get("tls_client_ca"))

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        stamp = self._stamp()
        with self._lock:
            if stamp == self._seen:
                return None
            try:
                self.config = self._load()
            except _Unreadable as exc:  # (out of descriptors, say): the next handshake retries
                if stamp != self._unread:
                    self._unread = stamp
                    log.warning("TLS files changed but cannot be read yet; the previous "
                                "ones serve on: %s", exc)  # fmt: skip
                return None
            except StartupError as exc:  # their content: tried again once they change
                self._seen = stamp
                log.warning("TLS files changed but do not load; the previous ones serve on: %s",
                            exc)  # fmt: skip
                return None
            self._seen = stamp
        log.info("TLS: reloaded %s: new connections get it", self.paths["tls_cert"])
        return self.config


def server_credentials(settings: ServerSettings) -> grpc.ServerCredentials:
    """The gRPC port's TLS credentials, reloaded on rotation; mutual TLS with tls_client_ca."""
    fetch = Reloader(settings)
    mutual = settings.tls_client_ca
    log.info("TLS on the gRPC port: %s%s", settings.tls_cert,
             f"; mutual, callers' certificates of {mutual}" if mutual else "")  # fmt: skip
    return grpc.dynamic_ssl_server_credentials(
        fetch.config, fetch, require_client_authentication=mutual is not None
    )


class _Unreadable(StartupError):
    """A TLS file that could not be read (as opposed to one whose content is wrong)."""


def _read(path: Path, field: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise _Unreadable(f"{field} {path}: {exc.strerror or exc} "
                           f"({FLAGS[field]}, GRACE_{field.upper()})") from None  # fmt: skip


def _check(pem: dict[str, bytes], paths: dict[str, Path]) -> None:
    """What grpc would only find at a handshake: that the key is the certificate's, and
    each file holds PEM (OpenSSL through the standard library)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        with _memfile(pem["tls_cert"]) as cert, _memfile(pem["tls_key"]) as key:
            context.load_cert_chain(cert, key, password=lambda: b"")  # never a prompt
    except ssl.SSLError as exc:
        raise StartupError(f"tls_cert {paths['tls_cert']} and tls_key {paths['tls_key']} do "
                           "not load as a PEM certificate and its unencrypted key: "
                           f"{exc.reason or exc} (--tls-cert, --tls-key)") from None  # fmt: skip
    if "tls_client_ca" in pem:
        try:
            context.load_verify_locations(cadata=pem["tls_client_ca"].decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as exc:  # ValueError: an empty file
            why = getattr(exc, "reason", None) or exc
            raise StartupError(f"tls_client_ca {paths['tls_client_ca']}: no PEM CA certificate: "
                               f"{why} (--tls-client-ca)") from None  # fmt: skip


@contextlib.contextmanager
def _memfile(data: bytes) -> Iterator[str]:
    """`data` as a path for OpenSSL that never touches a disk (a private key must not)."""
    fd = os.memfd_create("grace-tls")
    try:
        os.write(fd, data)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def channel(
    target: str,
    ca: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    server_name: str | None = None,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.Channel:
    """A client channel to `target`: TLS when any path is given (PEM paths; `ca` the
    roots the server's certificate must chain to, default grpc's public ones; `cert` and
    `key` the client's own, for mutual TLS; `server_name` the name the server's certificate
    must carry when not the target's host), else plain text."""
    if ca is None and cert is None and key is None:
        if server_name:
            raise ValueError("a TLS server name needs TLS: give the CA (--tls-ca) too")
        return grpc.insecure_channel(target, options=options)
    if (cert is None) != (key is None):
        raise ValueError("a client certificate and its key go together: give both or neither")
    roots, chain, private = (None if p is None else Path(p).read_bytes() for p in (ca, cert, key))
    credentials = grpc.ssl_channel_credentials(roots, private, chain)
    named = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(target, credentials, options=[*options, *named])


def client_env() -> dict[str, str | None]:
    """A client's TLS paths and server name from GRACE_TLS_* (unset: None)."""
    return {k: os.environ.get(name) or None for k, name in CLIENT_ENV.items()}
