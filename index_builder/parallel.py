"""Numpy helpers for building paper-scale indexes (30 M ads), most of them on threads.

Used by the index build, the SID tokenizer and the synthetic world. Every helper returns
exactly what its serial numpy equivalent returns, whatever `workers`: work is split into
contiguous row ranges whose results are concatenated in order. Threads, not processes:
numpy releases the GIL inside gathers, ufuncs and `reduceat`, and threads share arrays.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

T = TypeVar("T")

# Below this many rows a split costs more in thread hand-offs than it saves.
MIN_ROWS_PER_TASK = 1 << 16


def default_workers() -> int:
    """The CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def even_cuts(n: int, parts: int) -> list[int]:
    """0 = c_0 <= c_1 <= ... <= c_parts = n, as even as integers allow."""
    parts = max(1, parts)
    return [n * i // parts for i in range(parts + 1)]


def ranges(n: int, workers: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges covering [0, n): one per worker, none under MIN_ROWS_PER_TASK."""
    parts = max(1, min(workers, n // MIN_ROWS_PER_TASK))
    return list(itertools.pairwise(even_cuts(n, parts)))


def blocks(n: int, size: int = MIN_ROWS_PER_TASK) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of `size` rows covering [0, n) (the last one shorter): tasks
    whose temporaries stay a few MB however large n is."""
    return [(lo, min(n, lo + size)) for lo in range(0, n, size)]


def run(fn: Callable[..., T], items: Sequence[object], workers: int) -> list[T]:
    """[fn(*item) for item in items], on up to `workers` threads; results in input order."""
    if workers <= 1 or len(items) <= 1:
        return [fn(*item) for item in items]  # type: ignore[misc]
    with ThreadPoolExecutor(min(workers, len(items))) as pool:
        return list(pool.map(lambda item: fn(*item), items))  # type: ignore[misc]


def take_segments(offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows `rows` of a ragged array with `offsets` int64 [n + 1], in that order: their
    offsets int64 [len(rows) + 1] and the flat positions of their values int64 [nnz].
    Made a block of rows at a time: no temporary of one int64 per row."""
    out = np.empty(len(rows) + 1, dtype=np.int64)
    out[0] = 0
    for lo, hi in blocks(len(rows), 1 << 20):
        at = rows[lo:hi]
        np.subtract(offsets[at + 1], offsets[at], out=out[lo + 1 : hi + 1])
    np.cumsum(out, out=out)
    flat = np.empty(int(out[-1]), dtype=np.int64)
    for lo, hi in blocks(len(rows), 1 << 20):
        bounds = out[lo : hi + 1]
        a, b = int(bounds[0]), int(bounds[-1])
        shift = offsets[rows[lo:hi]] - bounds[:-1]  # a row's start, less its new one
        part = flat[a:b]
        part[:] = np.repeat(shift, np.diff(bounds))
        part += np.arange(a, b, dtype=np.int64)
    return out, flat


def take(a: np.ndarray, idx: np.ndarray, workers: int) -> np.ndarray:
    """a[idx] along axis 0 (idx: int [m]), gathered by `workers` threads."""
    out = np.empty((len(idx), *a.shape[1:]), dtype=a.dtype)

    def part(lo: int, hi: int) -> None:
        np.take(a, idx[lo:hi], axis=0, out=out[lo:hi])

    run(part, ranges(len(idx), workers), workers)
    return out


def or_reduceat(
    rows: np.ndarray, starts: np.ndarray, workers: int, out: np.ndarray | None = None
) -> np.ndarray:
    """np.bitwise_or.reduceat(rows, starts, axis=0) for sorted, distinct `starts` with
    starts[0] == 0: one OR per segment [starts[i], starts[i+1]) (the last runs to the end).
    Segments are split between threads, never inside one. `out`: where to write it
    ([len(starts), ...] of rows' dtype; a new array if None)."""
    if out is None:
        out = np.empty((len(starts), *rows.shape[1:]), dtype=rows.dtype)
    if rows.size == 0:  # rows of no words (a schema without set attributes): nothing to OR
        return out

    def part(lo: int, hi: int) -> None:
        a0 = int(starts[lo])
        a1 = int(starts[hi]) if hi < len(starts) else len(rows)
        np.bitwise_or.reduceat(rows[a0:a1], starts[lo:hi] - a0, axis=0, out=out[lo:hi])

    run(part, ranges(len(starts), workers), workers)
    return out


def digit_keys(digits: np.ndarray, base: int) -> np.ndarray:
    """int64 [n]: the rows of int digits [n, l] read as base-`base` numbers, which sort like
    the rows (SIDs and SID prefixes)."""
    keys = np.zeros(len(digits), dtype=np.int64)
    for column in range(digits.shape[1]):
        keys = keys * base + digits[:, column].astype(np.int64)
    return keys


def stable_argsort(keys: np.ndarray, key_bits: int) -> np.ndarray:
    """np.argsort(keys, kind="stable") for int keys in [0, 2**key_bits): int64 [n].

    Packs (key, position) into one int64 and sorts the values: numpy's plain int64 sort
    is vectorised (x86-simd-sort), several times faster than the stable argsort, and the
    position in the low bits keeps equal keys in order. Falls back to the stable argsort
    when key and position do not fit in 63 bits.
    """
    n = len(keys)
    pos_bits = max(1, (n - 1).bit_length())
    if key_bits + pos_bits > 63 or (n and (keys.min() < 0 or keys.max() >> key_bits)):
        return np.argsort(keys, kind="stable")
    packed = keys.astype(np.int64) << pos_bits
    packed |= np.arange(n, dtype=np.int64)
    packed.sort()
    packed &= (1 << pos_bits) - 1
    return packed


def float_sort_bits(x: np.ndarray) -> np.ndarray:
    """uint32 keys that sort like float32 values >= 0 (+0.0 … +inf): the IEEE bit patterns
    of non-negative floats are monotone as unsigned integers. int64 [n]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not (x >= 0).all():  # false for NaN too
        raise ValueError("float_sort_bits takes values >= 0 (no NaN)")
    # -0.0 passes the test above but its bits would sort last: -0.0 + 0.0 is +0.0
    return (x + np.float32(0)).view(np.uint32).astype(np.int64)
