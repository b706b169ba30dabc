"""Ad chunks, drawn in this process or by a pool of forked workers (the ads stage's engine).

Chunk k always draws from `stream(seed, "ads", k)`, so workers may draw chunks in any
order; the parent consumes them in chunk order and writes exactly the bytes one process
writes. Workers fork after the advertisers and the ad layout exist, so they inherit them
(≈ 1 GB at 30 M ads) instead of receiving them pickled; each writes its embeddings into
the shared scratch memmap and sends back only what the parent stores or writes (its JSONL
lines too: the costliest part of a JSONL world).
"""

from __future__ import annotations

import multiprocessing as mp
import warnings
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from multiprocessing.pool import Pool

import numpy as np

from contracts.targeting_codec import Ragged
from index_builder.synth.ads import AdRules, AdState, fill_chunk, pool_keys, rules_of
from index_builder.synth.advertisers import Advertisers
from index_builder.synth.attributes import ExtraRules
from index_builder.synth.blocks import campaign_ids
from index_builder.synth.campaigns import Creatives
from index_builder.synth.geography import Geography
from index_builder.synth.profiles import WorldProfile, stream
from index_builder.synth.writer import jsonl_chunk

# AdState fields that `fill_chunk` draws, in `Chunk.fields` order
FIELDS = ("age_lo", "age_hi", "gender", "keep", "popularity", "geo_country", "geo_loc")


@dataclass(frozen=True)
class AdJob:
    """Everything a chunk needs; workers inherit it through fork."""

    profile: WorldProfile
    adv: Advertisers
    ads: AdState  # embedding: the shared scratch memmap; per-ad fields filled by chunks
    seed: int
    n_locations: int  # size of the location vocabulary (pool keys after it)
    location_names: np.ndarray | None  # object [V]; None = no JSONL catalog
    creatives: Creatives | None = None  # None: every ad its own content
    markets: Geography | None = None  # None: no ad varies its advertiser's targeting
    extra: ExtraRules | None = None  # None: the default rules only (`attributes.py`)

    @property
    def n_chunks(self) -> int:
        return -(-self.profile.n_ads // self.profile.chunk_ads)


@dataclass(frozen=True)
class Chunk:
    """One drawn chunk of ads [lo, hi)."""

    lo: int
    hi: int
    fields: tuple[np.ndarray, ...]  # FIELDS of ads [lo, hi)
    rules: AdRules  # row_keys are dropped on the way back from a worker
    bitmask: np.ndarray  # uint64 [hi - lo, bitmask_words]: by the world's schema
    pool_keys: np.ndarray  # int64 [m]: see `ads.pool_keys`
    pool_positions: np.ndarray  # int64 [m]
    jsonl: bytes | None  # the chunk's catalog lines, if the world keeps a JSONL catalog
    extra: tuple[Ragged, ...] = ()  # per `ExtraRules.columns`: the ads' extra rules
    campaign: np.ndarray | None = None  # int64 [hi - lo]: with the richer-targeting knobs


def draw_chunk(job: AdJob, k: int) -> Chunk:
    """Draw chunk k in this process: fields and embeddings land in `job.ads`."""
    p = job.profile
    lo = k * p.chunk_ads
    hi = min(p.n_ads, lo + p.chunk_ads)
    rng = stream(job.seed, "ads", k)
    fill_chunk(p, job.adv, job.ads, lo, hi, rng, job.creatives, job.markets)
    rules = rules_of(job.adv, job.ads, slice(lo, hi))
    keys, positions = pool_keys(rules, np.arange(lo, hi, dtype=np.int64), job.n_locations)
    advertiser = job.ads.advertiser[lo:hi]
    extra = job.extra.take(advertiser) if job.extra is not None else ()
    bitmask = rules.bitmasks() if job.extra is None else job.extra.bitmasks(rules, extra)
    campaign = None
    if p.richer_targeting or p.blocks:
        campaign = campaign_ids(advertiser, bitmask, rules.locations)
    jsonl = None
    if job.location_names is not None:
        emb = np.ascontiguousarray(job.ads.embedding[lo:hi], dtype=np.float32)
        columns = job.extra.columns if job.extra is not None else ()
        jsonl = jsonl_chunk(job.location_names, job.ads.ad_id[lo:hi], advertiser, emb, rules,
                            columns, extra, campaign)  # fmt: skip
    return Chunk(
        lo=lo,
        hi=hi,
        fields=tuple(getattr(job.ads, f)[lo:hi] for f in FIELDS),
        rules=rules,
        bitmask=bitmask,
        pool_keys=keys,
        pool_positions=positions,
        jsonl=jsonl,
        extra=extra,
        campaign=campaign,
    )


_JOB: AdJob | None = None  # set in the parent just before the workers fork


def _draw_in_worker(k: int) -> Chunk:
    assert _JOB is not None, "worker started without a job (not forked?)"
    chunk = draw_chunk(_JOB, k)
    # row_keys only serve the JSONL writer, which already ran here: don't pickle them
    return replace(chunk, rules=replace(chunk.rules, row_keys=()))


def store(ads: AdState, chunk: Chunk) -> None:
    """Copy a chunk's fields into the parent's AdState (a no-op copy when drawn here)."""
    for name, values in zip(FIELDS, chunk.fields, strict=True):
        getattr(ads, name)[chunk.lo : chunk.hi] = values


class ChunkStream:
    """Every chunk, in chunk order, drawn by `workers` forked processes (1: this one); the
    caller `store`s each. The workers fork on entering it, so enter it before starting
    threads of your own (fork copies only the calling thread). At most `workers + 2`
    chunks are in flight, so results never pile up in the parent."""

    def __init__(self, job: AdJob, workers: int) -> None:
        self.job = job
        self.workers = min(workers, job.n_chunks)
        if "fork" not in mp.get_all_start_methods():
            self.workers = 1
        self._pool: Pool | None = None

    def __enter__(self) -> ChunkStream:
        global _JOB
        if self.workers > 1:
            _JOB = self.job
            try:
                with warnings.catch_warnings():
                    # Python 3.12 warns when forking a process that has threads (numpy's
                    # BLAS pool): the workers only run numpy ufuncs, never BLAS or torch.
                    warnings.simplefilter("ignore", DeprecationWarning)
                    self._pool = mp.get_context("fork").Pool(self.workers)
            finally:
                _JOB = None  # the workers hold their own copy now
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __iter__(self) -> Iterator[Chunk]:
        n, pool = self.job.n_chunks, self._pool
        if pool is None:
            yield from (draw_chunk(self.job, k) for k in range(n))
            return
        ahead = min(n, self.workers + 2)
        pending = deque(pool.apply_async(_draw_in_worker, (k,)) for k in range(ahead))
        for k in range(ahead, n + ahead):
            chunk = pending.popleft().get()
            if k < n:
                pending.append(pool.apply_async(_draw_in_worker, (k,)))
            yield chunk
