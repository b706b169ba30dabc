"""SID tokenizer: content embeddings → Semantic IDs (docs/ARCHITECTURE.md §1, §3, §4).

The index builder calls `SIDTokenizer.assign` for catalog rows that carry an `embedding` but
no `sid`; the trained tokenizer is stored beside the model, and every index records its
`fingerprint` so the server can refuse an index built for another tokenizer.

A SID has `levels + 1` tokens in [0, codebook_size) (4 tokens of 512 by default):

- tokens 0 … levels-1 come from residual k-means (RQ-KMeans): level l's codebook clusters
  the residual that the levels before it left, and an embedding takes its nearest code
  (squared L2; ties go to the lowest code);
- the last token tells apart the ads that share a prefix (TIGER; `last_token.py`): they are
  ranked by the norm of their final residual, then by input order, and the rank picks the
  token. Tokens held by `reserved` SIDs (catalog rows with explicit SIDs) are skipped while
  the prefix has room. A prefix with more ads than codes wraps (rank mod codebook_size), so
  several ads share a full SID; the SID → ad index maps a SID to a range of ads, so that is
  legal, and `CollisionReport` counts it.

On disk a tokenizer is a directory holding `tokenizer.json` (format version, config, dim,
fingerprint) and `codebooks.safetensors` (float32 [levels, codebook_size, dim]).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from pathlib import Path

import numpy as np
import orjson
from safetensors.numpy import load_file, save_file
from tqdm import tqdm

from index_builder.kmeans import check_finite, kmeans, nearest, rq_encode
from index_builder.last_token import CollisionReport, complete_sids
from index_builder.parallel import default_workers

FORMAT_VERSION = 1
_KIND = "grace.sid_tokenizer"
_META_FILE = "tokenizer.json"
_CODEBOOK_FILE = "codebooks.safetensors"


@dataclass(frozen=True)
class TokenizerConfig:
    levels: int = 3  # RQ levels; a full SID has levels + 1 tokens
    codebook_size: int = 512  # codes per level, also the range of the last token
    iterations: int = 20  # Lloyd iterations per level (stops early once no point moves)
    train_sample: int = 200_000  # k-means is trained on a seeded sample of this many rows
    seed: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            low = 0 if f.name == "seed" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"TokenizerConfig.{f.name} must be an int >= {low}, got {value!r}")
        if self.codebook_size ** (self.levels + 1) > 2**62:
            raise ValueError("codebook_size ** (levels + 1) must fit in int64 (SID keys)")


_DEFAULT_CONFIG = TokenizerConfig()


class SIDTokenizer:
    """Trained RQ codebooks: `train` builds one, `assign` turns embeddings into SIDs."""

    def __init__(self, config: TokenizerConfig, codebooks: np.ndarray) -> None:
        shape = (config.levels, config.codebook_size)
        if (
            not isinstance(codebooks, np.ndarray)
            or codebooks.dtype != np.float32
            or codebooks.ndim != 3
            or codebooks.shape[:2] != shape
            or codebooks.shape[2] < 1
        ):
            raise ValueError(f"codebooks must be float32 [{shape[0]}, {shape[1]}, dim]")
        if not np.isfinite(codebooks).all():
            raise ValueError("codebooks hold NaN or inf")
        self.config = config
        self.codebooks = np.array(codebooks, dtype=np.float32, order="C")  # [levels, K, dim]
        self.codebooks.setflags(write=False)  # the fingerprint is cached

    @classmethod
    def train(
        cls,
        embeddings: np.ndarray,  # [N, dim] float
        config: TokenizerConfig = _DEFAULT_CONFIG,
        progress: bool = True,
        workers: int | None = None,  # threads for the distance tiles; None: every CPU
    ) -> SIDTokenizer:
        """Train on a seeded sample; the codebooks do not depend on `workers`."""
        x = _check_matrix(embeddings)
        if len(x) == 0:
            raise ValueError("cannot train a SID tokenizer on 0 embeddings")
        threads = default_workers() if workers is None else workers
        rng = np.random.default_rng(config.seed)
        rows = np.arange(len(x))
        if len(x) > config.train_sample:
            rows = np.sort(rng.choice(len(x), config.train_sample, replace=False))
        residual = np.ascontiguousarray(x[rows], dtype=np.float32)  # [S, dim]
        check_finite(residual, rows)
        k = config.codebook_size
        codebooks = np.empty((config.levels, k, x.shape[1]), np.float32)
        total = config.levels * config.iterations
        with tqdm(total=total, desc="SID k-means", unit="iter", disable=not progress) as bar:
            for level in range(config.levels):
                bar.set_postfix(level=level)
                codebooks[level] = kmeans(residual, k, config.iterations, rng, bar, threads)
                residual -= codebooks[level][nearest(residual, codebooks[level], threads)]
        return cls(config, codebooks)

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of config, codebook shape and codebook bytes; first 16 hex chars."""
        head = {"config": asdict(self.config), "shape": list(self.codebooks.shape)}
        h = hashlib.sha256(orjson.dumps(head, option=orjson.OPT_SORT_KEYS))
        h.update(self.codebooks.astype("<f4", copy=False).tobytes())
        return h.hexdigest()[:16]

    @property
    def dim(self) -> int:
        return int(self.codebooks.shape[2])

    def encode_prefix(
        self, embeddings: np.ndarray, *, device: str = "cpu", workers: int | None = None
    ) -> np.ndarray:
        """int32 [N, levels]: the RQ codes (every token but the last) of each embedding."""
        return self._encode(embeddings, device, workers)[0]

    def reconstruct(self, prefix: np.ndarray) -> np.ndarray:
        """float32 [N, dim]: the sum of the codes a prefix [N, l <= levels] names."""
        prefix = np.asarray(prefix)
        out = np.zeros((len(prefix), self.dim), np.float32)
        for level in range(prefix.shape[1]):
            out += self.codebooks[level][prefix[:, level]]
        return out

    def assign(
        self,
        embeddings: np.ndarray,  # [N, dim] float
        reserved: np.ndarray | None = None,  # int [M, levels + 1]: SIDs already taken
        *,
        device: str = "cpu",
        workers: int | None = None,
    ) -> tuple[np.ndarray, CollisionReport]:
        """int32 [N, levels + 1] full SIDs, in input order, and the catalog's collisions.

        `device`/`workers`: where the RQ codes are computed (see `kmeans.rq_encode`; None
        workers: every CPU); the SIDs do not depend on `workers`, and on a GPU differ from
        the CPU's only where a code is a near-tie.
        """
        prefix, residual_norm = self._encode(embeddings, device, workers)
        taken = self._check_reserved(reserved)
        return complete_sids(prefix, residual_norm, taken, self.config.codebook_size)

    def save(self, path: Path) -> None:
        """Write the tokenizer into directory `path` (created if missing)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        meta = {
            "kind": _KIND,
            "format_version": FORMAT_VERSION,
            "config": asdict(self.config),
            "dim": self.dim,
            "fingerprint": self.fingerprint,
        }
        tmp = path / f".{_CODEBOOK_FILE}.tmp"
        save_file(
            {"codebooks": self.codebooks}, str(tmp), metadata={"fingerprint": self.fingerprint}
        )
        os.replace(tmp, path / _CODEBOOK_FILE)
        tmp = path / f".{_META_FILE}.tmp"
        tmp.write_bytes(orjson.dumps(meta, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
        os.replace(tmp, path / _META_FILE)

    @staticmethod
    def ready(path: Path) -> bool:
        """Whether a complete tokenizer is saved at path (`save` writes the meta file last,
        so its presence means the codebooks are there too)."""
        return (Path(path) / _META_FILE).is_file()

    @classmethod
    def load(cls, path: Path) -> SIDTokenizer:
        """Read a saved tokenizer; refuse it unless its fingerprint recomputes the same."""
        path = Path(path)
        meta_path, codebook_path = path / _META_FILE, path / _CODEBOOK_FILE
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
        if kind != _KIND or version != FORMAT_VERSION:
            raise ValueError(
                f"{meta_path}: kind {kind!r} format {version!r}; "
                f"this reader expects {_KIND!r} format {FORMAT_VERSION}"
            )
        try:
            codebooks = load_file(str(codebook_path))["codebooks"]
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"{codebook_path}: unreadable codebooks ({e})") from e
        tokenizer = cls(config, codebooks)
        if tokenizer.fingerprint != stored:
            raise ValueError(
                f"{path}: fingerprint mismatch (stored {stored}, recomputed "
                f"{tokenizer.fingerprint}); the files were modified or come from two tokenizers"
            )
        return tokenizer

    def __repr__(self) -> str:
        c = self.config
        return (
            f"SIDTokenizer(levels={c.levels}, codebook_size={c.codebook_size}, "
            f"dim={self.dim}, fingerprint={self.fingerprint})"
        )

    def _encode(
        self, embeddings: np.ndarray, device: str = "cpu", workers: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """int32 [N, levels] codes and float32 [N] squared norms of the final residual."""
        x = _check_matrix(embeddings, self.dim)
        threads = default_workers() if workers is None else workers
        return rq_encode(self.codebooks, x, device=device, workers=threads)

    def _check_reserved(self, reserved: np.ndarray | None) -> np.ndarray:
        width = self.config.levels + 1
        if reserved is None:
            return np.empty((0, width), np.int64)
        r = np.asarray(reserved)
        if r.ndim != 2 or r.shape[1] != width or not np.issubdtype(r.dtype, np.integer):
            raise ValueError(f"reserved must be int [M, {width}], got {r.dtype} {r.shape}")
        bad = ((r < 0) | (r >= self.config.codebook_size)).any(axis=1)
        if bad.any():
            raise ValueError(
                f"reserved row {int(np.argmax(bad))} has a token outside "
                f"[0, {self.config.codebook_size}): {r[np.argmax(bad)].tolist()}"
            )
        return r.astype(np.int64)


def _check_matrix(x: np.ndarray, dim: int | None = None) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] < 1:
        raise ValueError(f"embeddings must be a 2-D array [N, dim], got shape {x.shape}")
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise ValueError(f"embeddings must be real numbers, got dtype {x.dtype}")
    if dim is not None and x.shape[1] != dim:
        raise ValueError(f"embeddings have dim {x.shape[1]}, this tokenizer expects {dim}")
    return x
