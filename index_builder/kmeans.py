"""Seeded k-means on CPU (Lloyd's with k-means++ seeding): the SID tokenizer's engine.

`tokenizer.SIDTokenizer` trains one codebook per residual level with `kmeans` and assigns
codes with `nearest`. Deterministic for a seed and independent of the torch thread count
(sums are sequential float64 bincounts; ties go to the lowest code).
"""

from __future__ import annotations

import numpy as np
import torch
from tqdm import tqdm

# Distance tile of [2048, 512] float32 (4 MiB) stays in cache; 16k-row tiles ran 2x slower.
_TILE_ROWS = 2048
# k-means++ seeds from at most this many points per code (sequential, O(pool) per code).
_INIT_POINTS_PER_CODE = 32


def nearest(x: np.ndarray, codebook: np.ndarray) -> np.ndarray:
    """int64 [n]: nearest code of each row of x [n, dim] in codebook [K, dim] (float32)."""
    c = torch.tensor(codebook)  # a copy: 64 KiB, and the tokenizer's codebooks are read-only
    c_sq = (c * c).sum(1)  # [K]
    x_t = torch.from_numpy(x)
    codes = np.empty(len(x), np.int64)
    tile = torch.empty(min(len(x), _TILE_ROWS), len(codebook))  # [rows, K], reused
    for s in range(0, len(x), _TILE_ROWS):
        rows = x_t[s : s + _TILE_ROWS]
        # ||c||² - 2 x·c ranks codes like ||x - c||²: ||x||² is the same for every code.
        dist = torch.addmm(c_sq, rows, c.T, alpha=-2.0, out=tile[: len(rows)])
        # numpy's argmin is SIMD and ~5x faster than torch's row argmin here; first min wins.
        codes[s : s + len(rows)] = dist.numpy().argmin(axis=1)
    return codes


def kmeans(
    x: np.ndarray, k: int, iterations: int, rng: np.random.Generator, bar: tqdm
) -> np.ndarray:
    """float32 [k, dim] Lloyd's k-means of x [n, dim]; deterministic for `rng`'s state."""
    centroids = _kmeans_pp(x, k, rng)
    x_t = np.ascontiguousarray(x.T)  # [dim, n]: bincount over contiguous columns is 6x faster
    previous = None
    for done in range(1, iterations + 1):
        codes = nearest(x, centroids)
        counts = np.bincount(codes, minlength=k)
        # Sums in float64 by bincount: sequential, so independent of the thread count.
        sums = np.stack([np.bincount(codes, column, minlength=k) for column in x_t], 1)
        used = counts > 0
        centroids[used] = sums[used] / counts[used, None]
        reseeded = _reseed_empty(x, centroids, codes, np.flatnonzero(~used))
        bar.update(1)
        if not reseeded and previous is not None and np.array_equal(codes, previous):
            bar.update(iterations - done)  # converged: the centroids can no longer move
            break
        previous = codes
    return centroids


def _kmeans_pp(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding from a sample of at most k * _INIT_POINTS_PER_CODE rows."""
    pool = x
    if len(x) > k * _INIT_POINTS_PER_CODE:
        pool = x[np.sort(rng.choice(len(x), k * _INIT_POINTS_PER_CODE, replace=False))]
    centroids = np.empty((k, x.shape[1]), np.float32)
    centroids[0] = pool[rng.integers(len(pool))]
    d2 = ((pool - centroids[0]) ** 2).sum(1, dtype=np.float64)  # [pool] to nearest centroid
    for j in range(1, k):
        cumulative = np.cumsum(d2)
        if cumulative[-1] <= 0:
            # Fewer distinct points than codes: the spare codes duplicate one and stay unused
            # (ties go to the lowest code).
            centroids[j:] = centroids[0]
            break
        i = min(
            int(np.searchsorted(cumulative, rng.random() * cumulative[-1], "right")), len(pool) - 1
        )
        centroids[j] = pool[i]
        np.minimum(d2, ((pool - pool[i]) ** 2).sum(1, dtype=np.float64), out=d2)
    return centroids


def _reseed_empty(
    x: np.ndarray, centroids: np.ndarray, codes: np.ndarray, empty: np.ndarray
) -> int:
    """Move empty centroids onto the points farthest from their centroid; returns how many."""
    if not len(empty):
        return 0
    d2 = ((x - centroids[codes]) ** 2).sum(1)
    for n, j in enumerate(empty):
        i = int(np.argmax(d2))
        if d2[i] <= 0:  # every point sits on a centroid: nothing left to split
            return n
        centroids[j] = x[i]
        np.minimum(d2, ((x - x[i]) ** 2).sum(1), out=d2)
    return len(empty)
