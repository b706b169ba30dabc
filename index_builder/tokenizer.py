"""SID tokenizer: content embeddings → Semantic IDs (docs/TOKENIZER.md).

The index builder calls `SIDTokenizer.assign` for catalog rows that carry an `embedding`
but no `sid`; every index records the tokenizer's `fingerprint`, so the server can refuse
an index built for another. A SID is `levels` RQ-KMeans codes (`kmeans.py`) and a last
token (`last_token.py`: "rank" or "code"). On disk: `contracts/tokenizer_format.py`.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import numpy as np
from tqdm import tqdm

from contracts import tokenizer_format
from contracts.tokenizer_format import TokenizerConfig
from index_builder.kmeans import check_finite, kmeans, nearest, rq_encode
from index_builder.last_token import CollisionReport, code_sids, complete_sids
from index_builder.parallel import default_workers

_DEFAULT_CONFIG = TokenizerConfig()


class SIDTokenizer:
    """Trained RQ codebooks: `train` builds one, `assign` turns embeddings into SIDs."""

    def __init__(self, config: TokenizerConfig, codebooks: np.ndarray) -> None:
        shape = (config.rq_levels, config.codebook_size)
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
        self.codebooks = np.array(codebooks, dtype=np.float32, order="C")  # [rq_levels, K, dim]
        self.codebooks.setflags(write=False)  # the fingerprint is cached

    @classmethod
    def train(
        cls,
        embeddings: np.ndarray,  # [N, dim] float
        config: TokenizerConfig = _DEFAULT_CONFIG,
        progress: bool = True,
        workers: int | None = None,  # threads for the distance tiles; None: every CPU
    ) -> SIDTokenizer:
        """Train `config.rq_levels` codebooks on a seeded sample; they do not depend on
        `workers`. In "code" mode the first `levels` equal those "rank" mode trains for the
        same config and data (the extra level is trained last, on the same random stream)."""
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
        codebooks = np.empty((config.rq_levels, k, x.shape[1]), np.float32)
        total = config.rq_levels * config.iterations
        with tqdm(total=total, desc="SID k-means", unit="iter", disable=not progress) as bar:
            for level in range(config.rq_levels):
                bar.set_postfix(level=level)
                codebooks[level] = kmeans(residual, k, config.iterations, rng, bar, threads)
                residual -= codebooks[level][nearest(residual, codebooks[level], threads)]
        return cls(config, codebooks)

    @cached_property
    def fingerprint(self) -> str:
        """`tokenizer_format.fingerprint` of the config and codebooks."""
        return tokenizer_format.fingerprint(self.config, self.codebooks)

    @property
    def dim(self) -> int:
        return int(self.codebooks.shape[2])

    def encode_prefix(
        self, embeddings: np.ndarray, *, device: str = "cpu", workers: int | None = None
    ) -> np.ndarray:
        """int32 [N, levels]: the RQ codes of each embedding's prefix (every token but the
        last, in either mode)."""
        return self._encode(embeddings, device, workers, self.config.levels)[0]

    def assign(
        self,
        embeddings: np.ndarray | list[np.ndarray],  # [N, dim] float, or handed over: [it]
        reserved: np.ndarray | None = None,  # int [M, levels + 1]: SIDs already taken
        *,
        device: str = "cpu",
        workers: int | None = None,
    ) -> tuple[np.ndarray, CollisionReport]:
        """int32 [N, levels + 1] full SIDs, in input order, and the catalog's collisions
        (the new ads plus `reserved`; how each mode treats them: `last_token.py`).
        `device` / `workers` (None: every CPU): where the RQ codes are computed
        (`kmeans.rq_encode`). Embeddings handed over in a one-element list (emptied here,
        the caller holding no other reference) are freed once RQ-encoded, before the last
        tokens' sorts: at paper scale 128 bytes per ad off the build's peak."""
        x = embeddings.pop() if isinstance(embeddings, list) else embeddings
        codes, residual_norm = self._encode(x, device, workers)
        del x
        taken = self._check_reserved(reserved)
        k = self.config.codebook_size
        if self.config.last_token == "code":
            return code_sids(codes, taken, k)
        return complete_sids(codes, residual_norm, taken, k)

    def save(self, path: Path) -> None:
        """Write the tokenizer into directory `path` (created if missing)."""
        tokenizer_format.write(path, self.config, self.codebooks)

    ready = staticmethod(tokenizer_format.ready)

    @classmethod
    def load(cls, path: Path) -> SIDTokenizer:
        """Read a saved tokenizer (`tokenizer_format.read`: refused unless its
        fingerprint recomputes the same)."""
        config, codebooks, _ = tokenizer_format.read(path)
        return cls(config, codebooks)

    def __repr__(self) -> str:
        c = self.config
        mode = "" if c.last_token == "rank" else f", last_token={c.last_token!r}"
        return (
            f"SIDTokenizer(levels={c.levels}, codebook_size={c.codebook_size}{mode}, "
            f"dim={self.dim}, fingerprint={self.fingerprint})"
        )

    def _encode(
        self, embeddings: np.ndarray, device: str, workers: int | None, levels: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """int32 [N, levels] codes (default: every level) and float32 [N] squared norms of
        the final residual."""
        x = _check_matrix(embeddings, self.dim)
        threads = default_workers() if workers is None else workers
        return rq_encode(self.codebooks[:levels], x, device=device, workers=threads)

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
