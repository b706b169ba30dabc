"""Seeded k-means on CPU (Lloyd's with k-means++ seeding) and residual encoding: the SID
tokenizer's engine (docs/TOKENIZER.md "Training", "Assigning at scale").

`tokenizer.SIDTokenizer` trains one codebook per residual level with `kmeans` and encodes
catalogs with `rq_encode`, on the CPU or a torch device. Codes never depend on the thread
count: sums are sequential float64 bincounts, tiles are fixed, ties go to the lowest code.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import numpy as np
import torch
from tqdm import tqdm

from index_builder import parallel

# A distance tile of [2048, 512] float32 (4 MiB) stays in cache.
_TILE_ROWS = 2048
# CPU encoding chunk: rows converted to float32 and checked at once, so 30M x 32 inputs
# never get copied whole. A multiple of _TILE_ROWS, so chunking never changes the tiles.
CPU_CHUNK_ROWS = 65_536
# Device encoding: chunks of 1 M rows cross to the device (128 MiB at dim 32), and each
# matmul takes one 65,536-row tile (128 MiB of [rows, 512] distances). Every tile starts
# at a multiple of the tile size, so the GEMM shapes, hence the float results, are the
# same however the input is chunked.
DEVICE_CHUNK_ROWS = 1 << 20
DEVICE_TILE_ROWS = 1 << 16
# k-means++ seeds from at most this many points per code (sequential, O(pool) per code).
_INIT_POINTS_PER_CODE = 32


def nearest(x: np.ndarray, codebook: np.ndarray, workers: int = 1) -> np.ndarray:
    """int64 [n]: nearest code of each row of x [n, dim] in codebook [K, dim] (float32).

    Tiles of `_TILE_ROWS` rows, spread over `workers` threads that each run torch on one
    thread: a [2048, 32] x [32, 512] matmul is too small to split, and torch's OpenMP
    threads spin at every tile's barrier. Tiles are the same for any `workers`, so are
    the codes.
    """
    c = torch.tensor(codebook)  # a copy: 64 KiB, and the tokenizer's codebooks are read-only
    c_sq = (c * c).sum(1)  # [K]
    x_t = torch.from_numpy(x)
    codes = np.empty(len(x), np.int64)

    def tiles(lo: int, hi: int) -> None:
        tile = torch.empty(min(hi - lo, _TILE_ROWS), len(codebook))  # [rows, K], reused
        for s in range(lo, hi, _TILE_ROWS):
            rows = x_t[s : min(hi, s + _TILE_ROWS)]
            # ||c||² - 2 x·c ranks codes like ||x - c||²: ||x||² is the same for every code.
            dist = torch.addmm(c_sq, rows, c.T, alpha=-2.0, out=tile[: len(rows)])
            # numpy's argmin is SIMD and ~5x faster than torch's row argmin; first min wins.
            codes[s : s + len(rows)] = dist.numpy().argmin(axis=1)

    n_tiles = -(-len(x) // _TILE_ROWS)
    cuts = [min(len(x), t * _TILE_ROWS) for t in parallel.even_cuts(n_tiles, workers)]
    with _torch_setting("num_threads", 1):
        parallel.run(tiles, list(itertools.pairwise(cuts)), workers)
    return codes


def kmeans(
    x: np.ndarray, k: int, iterations: int, rng: np.random.Generator, bar: tqdm, workers: int = 1
) -> np.ndarray:
    """float32 [k, dim] Lloyd's k-means of x [n, dim]; deterministic for `rng`'s state,
    whatever `workers` (threads computing the nearest codes)."""
    centroids = _kmeans_pp(x, k, rng)
    x_t = np.ascontiguousarray(x.T)  # [dim, n]: bincount over contiguous columns is 6x faster
    previous = None
    for done in range(1, iterations + 1):
        codes = nearest(x, centroids, workers)
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
        pick = rng.random() * cumulative[-1]
        i = min(int(np.searchsorted(cumulative, pick, "right")), len(pool) - 1)
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


def check_finite(x: np.ndarray, rows: np.ndarray | int) -> None:
    """Raise for the first row of float32 `x` that holds NaN/inf. `rows`: the input row
    id of each row of x, or of x[0] when the rows are contiguous."""
    bad = ~np.isfinite(x).all(axis=1)
    if bad.any():
        i = int(np.argmax(bad))
        row = rows + i if isinstance(rows, int) else int(rows[i])
        raise ValueError(f"embeddings row {row} holds NaN or inf (or overflows float32)")


def rq_encode(
    codebooks: np.ndarray,  # float32 [levels, K, dim]
    x: np.ndarray,  # [N, dim], any real dtype (may be memory-mapped)
    device: str = "cpu",
    workers: int = 1,
    chunk_rows: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Residual quantisation: int32 [N, levels] codes (nearest code per level on the
    residual the levels before left) and float32 [N] squared norms of the final residual.

    device "cpu": `CPU_CHUNK_ROWS`-row chunks on `workers` threads (see `nearest`). Any
    other torch device: `DEVICE_CHUNK_ROWS`-row chunks moved there; its float rounding
    differs, so a near-tie may pick another code there than on the CPU.
    """
    levels = len(codebooks)
    codes = np.empty((len(x), levels), np.int32)
    norm = np.empty(len(x), np.float32)
    if torch.device(device).type != "cpu":
        _encode_on_device(codebooks, x, torch.device(device), codes, norm, chunk_rows)
        return codes, norm
    rows = chunk_rows or CPU_CHUNK_ROWS
    assert rows % _TILE_ROWS == 0 or rows >= len(x), "CPU chunks must be whole tiles"

    def chunk(start: int) -> None:
        residual = np.array(x[start : start + rows], dtype=np.float32, order="C")
        check_finite(residual, start)
        stop = start + len(residual)
        for level, codebook in enumerate(codebooks):
            code = nearest(residual, codebook)
            codes[start:stop, level] = code
            residual -= codebook[code]
        norm[start:stop] = np.einsum("ij,ij->i", residual, residual)

    with _torch_setting("num_threads", 1):  # parallel over chunks, not in each small matmul
        parallel.run(chunk, [(s,) for s in range(0, len(x), rows)], workers)
    return codes, norm


@contextlib.contextmanager
def _torch_setting(name: str, value: object) -> Iterator[None]:
    """torch's process-wide setting `name` (`torch.get_<name>` / `set_<name>`) at `value`
    inside, restored after. A no-op when it already is `value`: nested uses on worker
    threads never flip it."""
    get, put = getattr(torch, f"get_{name}"), getattr(torch, f"set_{name}")
    before = get()
    if before == value:
        yield
        return
    put(value)
    try:
        yield
    finally:
        put(before)


def _encode_on_device(
    codebooks: np.ndarray,  # float32 [levels, K, dim]
    x: np.ndarray,  # [N, dim]
    device: torch.device,
    codes: np.ndarray,  # int32 [N, levels], filled
    norm: np.ndarray,  # float32 [N], filled
    chunk_rows: int | None,
    tile_rows: int = DEVICE_TILE_ROWS,
) -> None:
    rows = chunk_rows or DEVICE_CHUNK_ROWS
    assert rows % tile_rows == 0, "device chunks must be whole tiles"
    cb = torch.tensor(codebooks, device=device)  # [levels, K, dim]
    cb_sq = (cb * cb).sum(-1)  # [levels, K]
    # full fp32 matmuls: TF32's 10-bit mantissa would move codes
    with _torch_setting("float32_matmul_precision", "highest"):
        for start in range(0, len(x), rows):
            host = np.array(x[start : start + rows], dtype=np.float32, order="C")
            chunk = torch.from_numpy(host).to(device)  # [rows, dim]
            if not bool(torch.isfinite(chunk).all()):
                check_finite(host, start)  # names the row
            out = torch.empty((len(host), len(codebooks)), dtype=torch.int32, device=device)
            sq = torch.empty(len(host), dtype=torch.float32, device=device)
            for t in range(0, len(host), tile_rows):
                residual = chunk[t : t + tile_rows]  # a view: updated in place
                for level in range(len(codebooks)):
                    # ||c||² - 2 x·c ranks codes like ||x - c||²; argmin takes the first min
                    dist = torch.addmm(cb_sq[level], residual, cb[level].T, alpha=-2.0)
                    code = dist.argmin(1)
                    out[t : t + tile_rows, level] = code
                    residual -= cb[level][code]
                sq[t : t + tile_rows] = (residual * residual).sum(1)
            codes[start : start + len(host)] = out.cpu().numpy()
            norm[start : start + len(host)] = sq.cpu().numpy()
