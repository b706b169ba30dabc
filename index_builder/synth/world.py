"""Generate a synthetic ads world and read it back: the synth package's front door.

`generate_world` runs the flow, each stage on its own random stream (profile → geography
→ topics, advertisers → ads in chunks → catalog files and pool index → users → histories
→ eligibility → users/held-out files → world.json → rename into `out`); `load_world`
(`reader.py`) reads a world for tests, training and evaluation.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from index_builder.synth import campaigns, writer
from index_builder.synth.ads import EncodedAds, allocate_ads
from index_builder.synth.advertisers import build_advertisers, build_topics
from index_builder.synth.attributes import SCHEMA_FILE, build_extra_rules, write_schema
from index_builder.synth.audiences import build_segments
from index_builder.synth.blocks import Blocks, draw_blocks
from index_builder.synth.calibration import estimate_eligibility
from index_builder.synth.chunks import AdJob, ChunkStream, store
from index_builder.synth.geography import Geography, build_geography
from index_builder.synth.histories import CandidateIndex, Histories, sample_histories
from index_builder.synth.profiles import PROFILES, STYLES, WorldProfile, stream
from index_builder.synth.reader import WORLD_FORMAT
from index_builder.synth.user_attributes import UserAttributes, build_user_attributes
from index_builder.synth.users import build_users

# training and evaluation import these from here
__all__ = ["generate_world"]


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
        segments = build_segments(p, stream(seed, "audiences")) if p.n_audiences else None
        extra_rules = build_extra_rules(p, geo, adv, segments, seed)
        names = geo.names if jsonl else None
        job = AdJob(p, adv, ads, seed, len(geo.names), names, creatives, markets, extra_rules)
        index, enc, rule_counts, tkeys = _write_catalog(job, geo, tmp, progress, workers)
        per_style = np.bincount(adv.style[ads.advertiser], minlength=len(STYLES))
        style_counts = {s: int(c) for s, c in zip(STYLES, per_style, strict=True)}
        lap("ads")

        users = build_users(p, geo, topics, seed, stream(seed, "users"))
        extra = build_user_attributes(p, topics, users, segments, extra_rules, seed)
        lap("users")
        hist = sample_histories(p, geo, ads, enc, users, index, stream(seed, "histories"),
                                progress, fresh, extra)  # fmt: skip
        del index
        lap("histories")
        elig = estimate_eligibility(p, geo, ads, enc, users, stream(seed, "calibration"), extra)
        lap("eligibility")
        blocks = draw_blocks(p, hist, ads, enc, seed)
        columns = {**(extra.columns(hist.user) if extra else {}),
                   **(blocks.columns() if blocks else {})}  # fmt: skip
        writer.write_users(tmp, geo, users, ads, hist, fresh, columns)
        if extra_rules is not None:
            write_schema(extra_rules.schema, tmp)
        lap("write_users")
        del emb, ads, enc
        emb_path.unlink()

        n_ev = np.diff(hist.offsets) - 1  # held-out event excluded
        timings["total"] = round(time.perf_counter() - t0, 3)
        summary: dict[str, Any] = {
            "format": WORLD_FORMAT,
            "profile": p.name,
            "seed": seed,
            "knobs": p.recorded_knobs(),
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
            **(
                {"targeting": _targeting_summary(extra, hist.user, blocks)}
                if p.richer_targeting or p.blocks
                else {}
            ),
            "eligibility": elig,
            "timings_s": timings,
            "files": [
                *([writer.CATALOG_JSONL] if jsonl else []),
                *writer.FILES,
                *([SCHEMA_FILE] if extra_rules is not None else []),
            ],
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
    columns = job.extra.columns if job.extra is not None else ()
    extra_counts = dict.fromkeys((f"{c.field}_rule" for c in columns), 0)
    jsonl, campaign_ids = job.location_names is not None, p.richer_targeting or p.blocks
    with (
        ChunkStream(job, workers) as chunks,  # forks first: before the writer's threads
        writer.CatalogWriter(
            directory, geo.names, p.embedding_dim, jsonl, columns, campaign_ids
        ) as cat,
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
            cat.write(ads.ad_id[lo:hi], ads.advertiser[lo:hi], emb, rules, chunk.jsonl,
                      chunk.extra, chunk.campaign)  # fmt: skip
            keys.append(chunk.pool_keys)
            positions.append(chunk.pool_positions)
            ragged = (rules.countries, rules.age_buckets, rules.genders, rules.locations)
            for name, r in zip(counts, ragged, strict=True):
                counts[name] += int(np.count_nonzero(np.diff(r.offsets)))
            for name, r in zip(extra_counts, chunk.extra, strict=True):
                extra_counts[name] += int(np.count_nonzero(np.diff(r.offsets)))
            bar.update(hi - lo)
        bar.close()
    index = CandidateIndex.build(keys, positions, len(geo.names))
    return index, EncodedAds.finish(enc, loc_chunks), counts | extra_counts, tkeys


def _targeting_summary(
    extra: UserAttributes | None, kept: np.ndarray, blocks: Blocks | None
) -> dict[str, Any]:
    """world.json["targeting"]: the schema's attributes, the kept users' audiences and the
    requests' blocks."""
    out: dict[str, Any] = {}
    if extra is not None:
        out["attributes"] = [a.name for a in extra.schema.attributes]
    if extra is not None and extra.audiences is not None and len(kept):
        n = np.diff(extra.audiences.offsets)[kept]
        out["mean_user_audiences"] = float(n.mean())
        out["max_user_audiences"] = int(n.max())
        out["share_users_without_audiences"] = float((n == 0).mean())
    return out | (blocks.summary() if blocks is not None else {})


def _fresh_summary(fresh: np.ndarray, hist: Histories) -> dict[str, float]:
    """world.json["fresh"]: the share of ads launched after the log, and of held-out events
    that show one (no logged event does: `sample_histories`)."""
    last = hist.offsets[1:] - 1
    return {
        "share_of_ads": float(fresh.mean()),
        "heldout_share": float(fresh[hist.ad[last]].mean()) if len(last) else 0.0,
    }
