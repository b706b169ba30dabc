"""The SID tokenizer's files: its config, its fingerprint, and the one writer/reader pair
of its directory (docs/TOKENIZER.md), so that the server checks a checkpoint's tokenizer
without the builder (`index_builder/tokenizer.py` makes them). On disk a tokenizer is a
directory holding `tokenizer.json` (kind, format version, config, dim, fingerprint) and
`codebooks.safetensors` (float32 [rq_levels, codebook_size, dim], where `rq_levels` is
`levels`, or `levels + 1` in "code" mode).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from safetensors.numpy import load_file, save_file

from contracts.sid_space import LAST_TOKENS, LastToken

FORMAT_VERSION = 1
KIND = "grace.sid_tokenizer"
META_FILE = "tokenizer.json"
CODEBOOK_FILE = "codebooks.safetensors"


@dataclass(frozen=True)
class TokenizerConfig:
    levels: int = 3  # prefix tokens; a full SID has levels + 1 tokens in either mode
    codebook_size: int = 512  # codes per level, also the range of the last token
    iterations: int = 20  # Lloyd iterations per level (stops early once no point moves)
    train_sample: int = 200_000  # k-means is trained on a seeded sample of this many rows
    seed: int = 0
    last_token: LastToken = "rank"  # "rank" or "code" (LAST_TOKENS): docs/TOKENIZER.md

    def __post_init__(self) -> None:
        if self.last_token not in LAST_TOKENS:
            raise ValueError(
                f"TokenizerConfig.last_token must be one of {LAST_TOKENS}, got {self.last_token!r}"
            )
        for f in (f for f in fields(self) if f.name != "last_token"):
            value = getattr(self, f.name)
            low = 0 if f.name == "seed" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"TokenizerConfig.{f.name} must be an int >= {low}, got {value!r}")
        if self.codebook_size ** (self.levels + 1) > 2**62:
            raise ValueError("codebook_size ** (levels + 1) must fit in int64 (SID keys)")

    @property
    def rq_levels(self) -> int:
        """Trained RQ-KMeans codebooks: `levels`, plus the last token's in "code" mode."""
        return self.levels + (self.last_token == "code")

    def to_dict(self) -> dict[str, Any]:
        """The config as `tokenizer.json` stores it and the fingerprint hashes it: every
        field, but `last_token` only when it is not "rank", so tokenizers from before the
        field keep their files and fingerprints (and an old file loads as "rank")."""
        out = asdict(self)
        if self.last_token == "rank":
            del out["last_token"]
        return out


def fingerprint(config: TokenizerConfig, codebooks: np.ndarray) -> str:
    """sha256 of config (`TokenizerConfig.to_dict`), codebook shape and codebook bytes;
    first 16 hex chars."""
    head = {"config": config.to_dict(), "shape": list(codebooks.shape)}
    h = hashlib.sha256(orjson.dumps(head, option=orjson.OPT_SORT_KEYS))
    h.update(codebooks.astype("<f4", copy=False).tobytes())
    return h.hexdigest()[:16]


def write(path: Path, config: TokenizerConfig, codebooks: np.ndarray) -> None:
    """Write a tokenizer into directory `path` (created if missing); the meta file goes
    last, so its presence means the codebooks are there (`ready`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    digest = fingerprint(config, codebooks)
    meta = {"kind": KIND, "format_version": FORMAT_VERSION, "config": config.to_dict(),
            "dim": int(codebooks.shape[2]), "fingerprint": digest}  # fmt: skip
    tmp = path / f".{CODEBOOK_FILE}.tmp"
    save_file({"codebooks": codebooks}, str(tmp), metadata={"fingerprint": digest})
    os.replace(tmp, path / CODEBOOK_FILE)
    tmp = path / f".{META_FILE}.tmp"
    tmp.write_bytes(orjson.dumps(meta, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
    os.replace(tmp, path / META_FILE)


def ready(path: Path) -> bool:
    """Whether a complete tokenizer is saved at `path`."""
    return (Path(path) / META_FILE).is_file()


def read(path: Path) -> tuple[TokenizerConfig, np.ndarray, str]:
    """(config, codebooks, fingerprint) of a saved tokenizer; FileNotFoundError for a
    missing file, ValueError unless the fingerprint recomputes the stored one. A config
    without `last_token` loads as "rank"."""
    path = Path(path)
    meta_path, codebook_path = path / META_FILE, path / CODEBOOK_FILE
    for p in (meta_path, codebook_path):
        if not p.is_file():
            raise FileNotFoundError(f"SID tokenizer file missing: {p}")
    try:
        meta = orjson.loads(meta_path.read_bytes())
        config = TokenizerConfig(**meta["config"])
        stored = meta["fingerprint"]
        kind, version = meta["kind"], meta["format_version"]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{meta_path}: not a valid SID tokenizer description ({e})") from e
    if kind != KIND or version != FORMAT_VERSION:
        raise ValueError(
            f"{meta_path}: kind {kind!r} format {version!r}; "
            f"this reader expects {KIND!r} format {FORMAT_VERSION}"
        )
    try:
        codebooks = load_file(str(codebook_path))["codebooks"]
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise ValueError(f"{codebook_path}: unreadable codebooks ({e})") from e
    digest = fingerprint(config, codebooks)
    if digest != stored:
        raise ValueError(
            f"{path}: fingerprint mismatch (stored {stored}, recomputed {digest}); "
            "the files were modified or come from two tokenizers"
        )
    return config, codebooks, digest
