"""Generate a synthetic ads world and read it back: the synth package's front door.

`generate_world` runs the flow, each stage on its own random stream (profile → geography
→ topics, advertisers → ads in chunks → catalog files and pool index → users → histories
→ eligibility → users/held-out files → world.json → rename into `out`); `load_world`
reads a world for tests, training and evaluation.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from tqdm import tqdm

from contracts.targeting import Targeting
from index_builder.synth import campaigns, writer
from index_builder.synth.ads import EncodedAds, allocate_ads
from index_builder.synth.advertisers import build_advertisers, build_topics
from index_builder.synth.calibration import estimate_eligibility
from index_builder.synth.chunks import AdJob, ChunkStream, store
from index_builder.synth.geography import Geography, build_geography
from index_builder.synth.histories import CandidateIndex, Histories, sample_histories
from index_builder.synth.profiles import PROFILES, STYLES, WorldProfile, stream
from index_builder.synth.users import build_users

WORLD_FORMAT = 1


def generate_world(
    profile: str | WorldProfile,
    seed: int,
    out: Path,
    *,
    n_ads: int | None = None,
    n_users: int | None = None,
    progress: bool = True,
    workers: int = 1,
    jsonl: bool = True,
) -> dict[str, Any]:
    """Write the world of `profile` (a `PROFILES` name or a profile of its own; counts
    optionally overridden) and `seed` into `out`; returns `world.json`'s summary. The same
    arguments give the same files whatever `workers` (processes drawing ad chunks);
    `jsonl=False` writes the catalog as Parquet only (what paper scale wants)."""
    if isinstance(profile, str) and profile not in PROFILES:
        raise KeyError(f"unknown profile {profile!r}; choose one of {sorted(PROFILES)}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    base = PROFILES[profile] if isinstance(profile, str) else profile
    p = base.with_counts(n_ads, n_users)
    out = Path(out)
    timings: dict[str, float] = {}
    t0 = t = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        timings[name] = round(now - t, 3)
        t = now

    tmp = writer.staging_dir(out)
    try:
        geo = build_geography(p, stream(seed, "geography"))
        topics = build_topics(p, stream(seed, "topics"))
        adv = build_advertisers(p, geo, topics, stream(seed, "advertisers"))
        lap("advertisers")

        # scratch file: 30 M embeddings stream through the page cache, not the heap
        emb_path = tmp / "_embeddings.npy"
        emb = np.lib.format.open_memmap(
            emb_path, mode="w+", dtype=np.float32, shape=(p.n_ads, p.embedding_dim)
        )
        ads = allocate_ads(adv, emb, seed, stream(seed, "ads-layout"))
        creatives = campaigns.build_creatives(p, adv, ads.advertiser, stream(seed, "creatives"))
        markets = campaigns.markets(p, geo)
        if creatives is not None and markets is not None and p.campaign_geo_by_creative:
            creatives = campaigns.with_markets(p, creatives, markets, adv,
                                               stream(seed, "creative-markets"))  # fmt: skip
        fresh = campaigns.fresh_ads(p, creatives, p.n_ads, stream(seed, "fresh"))
        names = geo.names if jsonl else None
        job = AdJob(p, adv, ads, seed, len(geo.names), names, creatives, markets)
        index, enc, rule_counts, tkeys = _write_catalog(job, geo, tmp, progress, workers)
        per_style = np.bincount(adv.style[ads.advertiser], minlength=len(STYLES))
        style_counts = {s: int(c) for s, c in zip(STYLES, per_style, strict=True)}
        lap("ads")

        users = build_users(p, geo, topics, seed, stream(seed, "users"))
        lap("users")
        hist = sample_histories(p, geo, ads, enc, users, index, stream(seed, "histories"),
                                progress, fresh)  # fmt: skip
        del index
        lap("histories")
        elig = estimate_eligibility(p, geo, ads, enc, users, stream(seed, "calibration"))
        lap("eligibility")
        writer.write_users(tmp, geo, users, ads, hist, fresh)
        lap("write_users")
        del emb, ads, enc
        emb_path.unlink()

        n_ev = np.diff(hist.offsets) - 1  # held-out event excluded
        timings["total"] = round(time.perf_counter() - t0, 3)
        summary: dict[str, Any] = {
            "format": WORLD_FORMAT,
            "profile": p.name,
            "seed": seed,
            "knobs": asdict(p),
            "counts": {
                "ads": p.n_ads,
                "advertisers": adv.n,
                "users": len(hist.user),
                "users_dropped_no_eligible_ad": users.n - len(hist.user),
                "history_events": int(n_ev.sum()),
                "mean_history_length": float(n_ev.mean()) if len(n_ev) else 0.0,
                "largest_advertiser_ads": int(adv.size.max()),
                "median_advertiser_ads": float(np.median(adv.size)),
                "mean_user_locations": float(np.diff(users.loc_offsets).mean()),
                **geo.counts(),
            },
            "ads": {
                "by_style": style_counts,
                **{f"share_{k}": v / p.n_ads for k, v in rule_counts.items()},
            },
            **(
                {"creatives": campaigns.creative_summary(creatives.creative, tkeys)}
                if creatives is not None
                else {}
            ),
            **({"fresh": _fresh_summary(fresh, hist)} if fresh is not None else {}),
            "eligibility": elig,
            "timings_s": timings,
            "files": [*([writer.CATALOG_JSONL] if jsonl else []), *writer.FILES],
        }
        writer.write_summary(tmp, summary)  # last: its presence marks a complete world
        writer.publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return summary


def _write_catalog(
    job: AdJob, geo: Geography, directory: Path, progress: bool, workers: int
) -> tuple[CandidateIndex, EncodedAds, dict[str, int], np.ndarray]:
    """Draw the ads chunk by chunk (on `workers` processes), streaming each into the
    catalog files and the pool index in chunk order; also returns each ad's targeting
    key (`campaigns.targeting_keys`; empty without creatives)."""
    p, ads = job.profile, job.ads
    keys, positions, loc_chunks = [], [], []
    tkeys = np.zeros(p.n_ads if job.creatives else 0, dtype=np.uint64)
    enc = EncodedAds.allocate(p.n_ads)
    counts = dict.fromkeys(("country_rule", "age_rule", "gender_rule", "location_rule"), 0)
    jsonl = job.location_names is not None
    with (
        ChunkStream(job, workers) as chunks,  # forks first: before the writer's threads
        writer.CatalogWriter(directory, geo.names, p.embedding_dim, jsonl=jsonl) as cat,
    ):
        bar = tqdm(total=p.n_ads, desc="ads", unit="ad", unit_scale=True, disable=not progress)
        for chunk in chunks:
            lo, hi, rules = chunk.lo, chunk.hi, chunk.rules
            store(ads, chunk)
            enc.store(lo, chunk.bitmask, rules.locations)
            if len(tkeys):
                tkeys[lo:hi] = campaigns.targeting_keys(chunk.bitmask, rules.locations)
            loc_chunks.append(rules.locations.values)
            emb = ads.embedding[lo:hi]
            cat.write(ads.ad_id[lo:hi], ads.advertiser[lo:hi], emb, rules, chunk.jsonl)
            keys.append(chunk.pool_keys)
            positions.append(chunk.pool_positions)
            ragged = (rules.countries, rules.age_buckets, rules.genders, rules.locations)
            for name, r in zip(counts, ragged, strict=True):
                counts[name] += int(np.count_nonzero(np.diff(r.offsets)))
            bar.update(hi - lo)
        bar.close()
    index = CandidateIndex.build(keys, positions, len(geo.names))
    return index, EncodedAds.finish(enc, loc_chunks), counts, tkeys


def _fresh_summary(fresh: np.ndarray, hist: Histories) -> dict[str, float]:
    """world.json["fresh"]: the share of ads launched after the log, and of held-out events
    that show one (no logged event does: `sample_histories`)."""
    last = hist.offsets[1:] - 1
    return {
        "share_of_ads": float(fresh.mean()),
        "heldout_share": float(fresh[hist.ad[last]].mean()) if len(last) else 0.0,
    }


@dataclass(frozen=True)
class UserHistories:
    """Users with their targeting, time-ordered histories and held-out next events, as
    training and evaluation read them: a generated `World`, or a team's own data
    (`training.user_data.UserData`)."""

    path: Path  # where they were read from
    summary: dict[str, Any]
    user_ids: np.ndarray  # int64 [U]
    targeting: tuple[Targeting, ...]  # [U]: the request attributes of each user
    history_offsets: np.ndarray  # int64 [U+1]: user u's events are [off[u], off[u+1])
    history_ad_ids: np.ndarray  # int64 [E], time-ordered per user
    history_types: np.ndarray  # int8 [E]: 1 view, 2 click, 3 conversion
    history_ts: np.ndarray  # int64 [E]: timestamp_ms
    heldout_ad_ids: np.ndarray  # int64 [U]: the next interaction; -1: the user has none
    heldout_types: np.ndarray  # int8 [U]
    heldout_ts: np.ndarray  # int64 [U]

    @property
    def n_users(self) -> int:
        return len(self.user_ids)

    def history(self, u: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ad_ids, types, timestamp_ms) of user position u, oldest first."""
        s = slice(self.history_offsets[u], self.history_offsets[u + 1])
        return self.history_ad_ids[s], self.history_types[s], self.history_ts[s]


@dataclass(frozen=True)
class World(UserHistories):
    """A generated world, read back (`path`: its directory; `summary`: its world.json)."""

    # bool [U]: the held-out ad launched after the log (worlds with `fresh_share` > 0)
    heldout_fresh: np.ndarray | None = None

    @property
    def catalog_parquet(self) -> Path:
        return self.path / writer.CATALOG_PARQUET


def load_world(directory: Path | str) -> World:
    """Read a world written by `generate_world`; refuses a directory without world.json."""
    d = Path(directory)
    if not (d / writer.WORLD_JSON).is_file():
        raise FileNotFoundError(f"{d} is not a complete world: {writer.WORLD_JSON} missing")
    summary = json.loads((d / writer.WORLD_JSON).read_text())
    if summary.get("format") != WORLD_FORMAT:
        raise ValueError(f"{d}: world format {summary.get('format')!r}, expected {WORLD_FORMAT}")
    users = pq.read_table(d / writer.USERS_PARQUET)
    held = pq.read_table(d / writer.HELDOUT_PARQUET)
    user_ids = users["user_id"].to_numpy()
    if not np.array_equal(user_ids, held["user_id"].to_numpy()):
        raise ValueError(f"{d}: users and held-out events are not aligned")
    cols = [users[k].to_pylist() for k in ("country", "age", "gender", "locations")]
    targeting = tuple(Targeting(c, a, g, tuple(loc)) for c, a, g, loc in zip(*cols, strict=True))
    hist = users["history_ad_id"].combine_chunks()
    lengths = hist.value_lengths().to_numpy(zero_copy_only=False)
    return World(
        path=d,
        summary=summary,
        user_ids=user_ids,
        targeting=targeting,
        history_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        history_ad_ids=hist.flatten().to_numpy(),
        history_types=users["history_type"].combine_chunks().flatten().to_numpy(),
        history_ts=users["history_ts"].combine_chunks().flatten().to_numpy(),
        heldout_ad_ids=held["ad_id"].to_numpy(),
        heldout_types=held["type"].to_numpy(),
        heldout_ts=held["timestamp_ms"].to_numpy(),
        heldout_fresh=held["fresh"].to_numpy() if "fresh" in held.column_names else None,
    )
