"""What the `grace` command modules share."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import grpc

    from contracts.targeting_schema import TargetingSchema

EXIT_BAD_INPUT = 2


class AddCommand(Protocol):
    def __call__(
        self, name: str, fn: Callable[[argparse.Namespace], int]
    ) -> argparse.ArgumentParser: ...


def show_progress(args: argparse.Namespace) -> bool:
    """Whether a command draws progress bars: not with --no-progress, and only on a
    terminal with text log lines — never into a log file, nor between JSON log lines."""
    from service.logs import JsonFormatter

    if args.no_progress or not sys.stderr.isatty():
        return False
    return not any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)


def add_tls_flags(p: argparse.ArgumentParser) -> None:
    """A client command's TLS: --tls-ca, --tls-cert, --tls-key, --tls-server-name."""
    p.add_argument("--tls-ca", help="TLS: PEM roots the server's certificate must chain to "
                   "($GRACE_TLS_CA; with neither this nor --tls-cert: plain text)")  # fmt: skip
    p.add_argument("--tls-cert", help="mutual TLS: this client's PEM certificate "
                   "($GRACE_TLS_CERT)")  # fmt: skip
    p.add_argument("--tls-key", help="mutual TLS: its PEM private key ($GRACE_TLS_KEY)")
    p.add_argument("--tls-server-name", help="the name the server's certificate must carry, "
                   "when not the target's host ($GRACE_TLS_SERVER_NAME)")  # fmt: skip


def channel(target: str, args: argparse.Namespace) -> grpc.Channel:
    """A channel to `target`, TLS as add_tls_flags' flags (else GRACE_TLS_*) say."""
    from service.tls import channel, client_env

    tls = {k: getattr(args, f"tls_{k}") or v for k, v in client_env().items()}
    return channel(target, **tls)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def share(text: str) -> float:
    """A share of a whole, 0 to 1."""
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a share from 0 to 1, got {text}")
    return value


def add_bad_row_budget(p: argparse.ArgumentParser) -> None:
    """--bad-row-budget of build-index and builder (index_builder/bad_rows.py)."""
    p.add_argument("--bad-row-budget", type=share, default=0.001, metavar="SHARE",
                   help="bad catalog rows (a broken line, an unknown value, a duplicate id) "
                   "are left out while they are at most this share of the rows (0.001 = "
                   "0.1 %%), each listed in OUT/catalog-rejects.jsonl; past it the build fails "
                   "and publishes nothing; 0: any bad row fails it")  # fmt: skip


KWAY_HELP = (
    "also build k-way partitioned matchers: 'static' (k per step 64,64,32,8), "
    "'static:K1,K2,K3,K4', 'dynamic' (k_max 32, target fill 0.25) or "
    "'dynamic:KMAX,FILL'. Costly at scale; the paper found no pass-rate gain."
)
AUTOTUNE_HELP = (
    "autotune the Triton kernels, as the server does: each new shape first benchmarks "
    "every config, minutes in all on a GPU; by default the kernels' fixed configs run "
    "(the same kernels; GRACE_AUTOTUNE=1 in the environment also asks for tuning)"
)


def offline_kernels(autotune: bool) -> None:
    """Before an offline command that decodes (grace train's evaluation, grace eval)
    imports the kernels: offline decoding meets new shapes as it goes and would benchmark
    every config of each (docs/MODEL.md), so these commands run the fixed configs unless
    `--autotune` or GRACE_AUTOTUNE says otherwise."""
    if autotune:
        os.environ["GRACE_AUTOTUNE"] = "1"
    else:
        os.environ.setdefault("GRACE_AUTOTUNE", "0")


CATALOG_HELP = (
    "catalog: a .jsonl/.ndjson/.json file (also .gz), a .parquet file, or a directory of "
    "such parts (docs/DATA.md)"
)
SCHEMA_HELP = (
    "targeting schema file (YAML or JSON, docs/FORMAT.md §1): the attributes the catalog "
    "carries and requests are checked against; default: the built-in country, age, "
    "gender, locations"
)


def targeting_schema(args: argparse.Namespace) -> TargetingSchema:
    """The --targeting-schema file, or the built-in default schema."""
    from contracts.targeting_schema import DEFAULT, load

    return load(Path(args.targeting_schema)) if args.targeting_schema else DEFAULT


SID_SPACE_HELP = (
    "no tokenizer: every catalog row carries its sid, an assignment made elsewhere that "
    "you name; the model must be trained with the same --sid-space (docs/DATA.md)"
)
LAST_TOKEN_HELP = (
    "the SID's last token: rank (TIGER: ranks the ads sharing a prefix, so a SID holds ~1 "
    "ad; the default) or code (one more RQ-KMeans level, so near-identical ads, e.g. the "
    "campaigns of one creative, share a SID): docs/TOKENIZER.md"
)
