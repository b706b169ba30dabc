"""World profiles: every knob of the synthetic ads world, as named frozen dataclasses.

`generate_world` looks a `WorldProfile` up in `PROFILES` and derives each stage's random
stream with `stream(...)`; each stage reads the few numbers it needs once. docs/SYNTH.md
documents the knobs and which of them drive the eligibility share.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace

import numpy as np

from contracts.targeting import AGE_BUCKETS

# Targeting styles, in the order of `WorldProfile.style_mix`.
STYLES: tuple[str, ...] = ("global", "national", "regional", "local")
GLOBAL, NATIONAL, REGIONAL, LOCAL = range(4)

# Common advertiser age rules as contiguous bucket ranges (lo, hi) into AGE_BUCKETS,
# with how often each is chosen among advertisers that have an age rule: "18+" dominates
# (no minors), then the classic marketing bands.
AGE_RULES: tuple[tuple[int, int, float], ...] = (
    (1, 6, 0.30),  # 18+
    (1, 2, 0.14),  # 18-34
    (2, 3, 0.14),  # 25-44
    (2, 4, 0.14),  # 25-54
    (3, 4, 0.08),  # 35-54
    (4, 6, 0.08),  # 45+
    (5, 6, 0.06),  # 55+
    (0, 1, 0.06),  # 13-24
)


# Extra enum attributes (`extra_enums` of them, in this order): name, catalog field, values
# and how users spread over them; each user has one value.
EXTRA_ENUMS: tuple[tuple[str, str, tuple[str, ...], tuple[float, ...]], ...] = (
    ("platform", "platforms", ("ios", "android", "web"), (0.35, 0.45, 0.20)),
    ("connection", "connections", ("wifi", "cellular"), (0.7, 0.3)),
)
MAX_USER_AUDIENCES = 300  # a user's audience segments, at most (the schema's request cap)
TARGETING_SHARES = (
    "audience_topic_share", "audience_rule_share", "audience_exclude_share", "enum_rule_share",
    "enum_exclude_share", "country_exclude_share", "age_exclude_share", "block_ad_share",
    "block_campaign_share", "block_advertiser_share",
)  # fmt: skip
TARGETING_KNOBS = (
    "n_audiences", "audiences_per_user", "audience_zipf", "extra_enums", "blocks_per_request",
    *TARGETING_SHARES,
)  # fmt: skip


@dataclass(frozen=True)
class WorldProfile:
    """All knobs of one synthetic world; `docs/SYNTH.md` documents each group."""

    name: str
    n_ads: int
    n_users: int
    # --- content
    embedding_dim: int = 32
    n_topics: int = 64
    topic_zipf: float = 0.8  # topic popularity ~ rank^-s
    advertiser_topic_noise: float = 0.35  # advertiser vector = topic centroid + this noise
    ad_noise: float = 0.12  # ad embedding = advertiser vector + this noise
    popularity_sigma: float = 1.0  # per-ad log-normal popularity spread
    # --- geography
    n_countries: int = 50  # taken from a fixed list of real markets, largest first
    country_zipf: float = 1.0  # country population share ~ rank^-s
    regions_per_country: tuple[int, int] = (4, 40)  # min, max (largest country gets max)
    region_zipf: float = 0.9
    cities_per_region: tuple[int, int] = (3, 120)
    city_zipf: float = 1.1
    neighbourhoods_per_city: tuple[int, int] = (1, 10)
    # --- advertisers and their targeting
    ads_per_advertiser: float = 20.0  # mean advertiser size
    advertiser_zipf: float = 0.9  # advertiser size ~ rank^-s
    style_mix: tuple[float, float, float, float] = (0.30, 0.40, 0.18, 0.12)  # STYLES order
    neighbour_country_share: float = 0.25  # national advertisers also targeting neighbours
    age_rule_share: float = 0.35  # advertisers with a contiguous age-bucket rule
    gender_rule_share: float = 0.15  # advertisers with a gender rule
    female_rule_share: float = 0.6  # of gender rules, the share targeting women
    rule_jitter: float = 0.10  # per ad: age range shifted by one bucket / gender rule dropped
    slot_keep: float = 0.8  # per ad: keep each non-first location / neighbour-country slot
    # --- creatives and campaigns (campaigns.py; the neutral values give the world without)
    ads_per_creative: float = 1.0  # mean ads sharing one creative (1 = no creatives)
    creative_noise: float = 0.0  # ad embedding = creative vector + this noise
    campaign_geo_share: float = 0.0  # ads targeting their own market, not the advertiser's
    campaign_demo_share: float = 0.0  # ads drawing their own age band / gender rule
    # campaign markets drawn once per creative (its ads share one market, a SID's ads are
    # eligible together or not at all) instead of per ad; needs creatives
    campaign_geo_by_creative: bool = False
    # share of creatives (of ads, without creatives) launched after the interaction log:
    # in the catalog and the index but in no history; a held-out next interaction may be
    # one of them, so no model trained on the log has seen where they may run
    fresh_share: float = 0.0
    # --- richer targeting (attributes.py, audiences.py, blocks.py; docs/SYNTH.md "Richer
    # targeting"): at the neutral values (the defaults) the world is the world without
    n_audiences: int = 0  # audience segments, a `set` attribute (0: none)
    audiences_per_user: float = 40.0  # mean segments per user (cut at MAX_USER_AUDIENCES)
    audience_zipf: float = 1.0  # segment popularity ~ rank^-s
    audience_topic_share: float = 0.6  # of a user's segments, the share of its topics'
    audience_rule_share: float = 0.2  # advertisers including 1-4 segments of their topic
    audience_exclude_share: float = 0.05  # advertisers excluding 1-2 ("existing customers")
    extra_enums: int = 0  # extra enum attributes (EXTRA_ENUMS): 1 platform, 2 + connection
    enum_rule_share: float = 0.2  # per extra enum: advertisers including some of its values
    enum_exclude_share: float = 0.1  # per extra enum: advertisers excluding one value
    country_exclude_share: float = 0.0  # advertisers excluding a country
    age_exclude_share: float = 0.0  # advertisers excluding an age bucket
    block_ad_share: float = 0.0  # requests blocking ads they were shown (frequency caps)
    block_campaign_share: float = 0.0  # requests blocking campaigns
    block_advertiser_share: float = 0.0  # requests blocking advertisers
    blocks_per_request: float = 3.0  # mean ids in a request's block list (at least 1)
    # --- users
    age_bucket_weights: tuple[float, ...] = (0.06, 0.20, 0.28, 0.19, 0.13, 0.08, 0.06)
    unknown_age_share: float = 0.05
    unknown_gender_share: float = 0.04
    nearby_cities_mean: float = 6.0  # other cities of the home region a user visits
    travel_cities_mean: float = 1.5  # cities anywhere (population-weighted)
    max_user_topics: int = 3
    interest_noise: float = 0.3
    # --- histories
    history_len_median: int = 40
    history_len_max: int = 256
    history_len_min: int = 3  # includes the held-out event
    candidates_per_user: int = 2048  # pool sample evaluated per user
    affinity_beta: float = 6.0  # event logit = beta * interest·embedding + log popularity
    click_rate: float = 0.12
    conversion_rate: float = 0.08  # of clicks
    # --- build
    chunk_ads: int = 262_144  # ads per streamed chunk (fixed: output depends on it)
    eligibility_users: int = 256  # user sample for the eligibility estimate
    eligibility_ads: int = 50_000  # catalog sample for the eligibility estimate
    topk_for_pass_rate: int = 500  # top-affinity ads per user for the pass-rate proxy

    def __post_init__(self) -> None:
        if self.n_ads < 1 or self.n_users < 1:
            raise ValueError(f"{self.name}: n_ads and n_users must be >= 1")
        if len(self.style_mix) != len(STYLES) or abs(sum(self.style_mix) - 1.0) > 1e-6:
            raise ValueError(f"{self.name}: style_mix must have {len(STYLES)} shares summing to 1")
        if len(self.age_bucket_weights) != len(AGE_BUCKETS):
            raise ValueError(f"{self.name}: age_bucket_weights needs {len(AGE_BUCKETS)} entries")
        if not 2 <= self.history_len_min <= self.history_len_median <= self.history_len_max:
            raise ValueError(f"{self.name}: need 2 <= history min <= median <= max")
        if self.ads_per_creative < 1.0 or self.creative_noise < 0.0:
            raise ValueError(f"{self.name}: need ads_per_creative >= 1, creative_noise >= 0")
        for share in (self.campaign_geo_share, self.campaign_demo_share):
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"{self.name}: campaign shares must lie in [0, 1]")
        if not 0.0 <= self.fresh_share < 1.0:
            raise ValueError(f"{self.name}: fresh_share must lie in [0, 1)")
        for lo, hi in (self.regions_per_country, self.cities_per_region):
            if not 1 <= lo <= hi:
                raise ValueError(f"{self.name}: ranges must satisfy 1 <= min <= max")
        self._check_targeting()

    def _check_targeting(self) -> None:
        if self.n_audiences and self.n_audiences < self.n_topics:
            raise ValueError(f"{self.name}: n_audiences must be 0 or >= n_topics "
                             f"({self.n_topics})")  # fmt: skip
        if not 0.0 <= self.audiences_per_user <= MAX_USER_AUDIENCES or self.audience_zipf < 0:
            raise ValueError(f"{self.name}: need 0 <= audiences_per_user <= "
                             f"{MAX_USER_AUDIENCES}, audience_zipf >= 0")  # fmt: skip
        if not 0 <= self.extra_enums <= len(EXTRA_ENUMS):
            raise ValueError(f"{self.name}: extra_enums must lie in [0, {len(EXTRA_ENUMS)}]")
        if not 1.0 <= self.blocks_per_request <= 1000.0:
            raise ValueError(f"{self.name}: blocks_per_request must lie in [1, 1000]")
        for knob in TARGETING_SHARES:
            if not 0.0 <= getattr(self, knob) <= 1.0:
                raise ValueError(f"{self.name}: {knob} must lie in [0, 1]")

    @property
    def richer_targeting(self) -> bool:
        """Whether the catalog carries more than the four include lists: extra attributes
        or exclusions (the world then writes its targeting schema file)."""
        return bool(self.n_audiences or self.extra_enums or self.country_exclude_share
                    or self.age_exclude_share)  # fmt: skip

    @property
    def blocks(self) -> bool:
        """Whether some requests carry block lists."""
        return bool(self.block_ad_share or self.block_campaign_share
                    or self.block_advertiser_share)  # fmt: skip

    def recorded_knobs(self) -> dict[str, object]:
        """world.json["knobs"]: every knob, the richer-targeting ones only for a world that
        uses them (so a world without them records what it recorded before they existed)."""
        knobs = asdict(self)
        if not (self.richer_targeting or self.blocks):
            for knob in TARGETING_KNOBS:
                del knobs[knob]
        return knobs

    def with_counts(self, n_ads: int | None = None, n_users: int | None = None) -> WorldProfile:
        """This profile with the ad / user counts overridden (None keeps the profile's)."""
        return replace(
            self,
            n_ads=self.n_ads if n_ads is None else n_ads,
            n_users=self.n_users if n_users is None else n_users,
        )

    def with_knobs(self, settings: Mapping[str, str]) -> WorldProfile:
        """This profile with knobs set from text (`grace synth --set KNOB=VALUE`): numbers
        as written, booleans as true / false, tuples as comma-separated numbers; an
        unknown knob or a value of the wrong kind is a one-line ValueError, and the
        profile's own checks then judge the result."""
        known = [f.name for f in fields(self) if f.name != "name"]
        changes: dict[str, object] = {}
        for knob, text in settings.items():
            if knob not in known:
                raise ValueError(f"unknown knob {knob!r}; the knobs: {', '.join(known)}")
            changes[knob] = _parse_knob(knob, text, getattr(self, knob))
        return replace(self, **changes)


PROFILES: dict[str, WorldProfile] = {
    p.name: p
    for p in (
        WorldProfile(
            name="tiny",
            n_ads=2_000,
            n_users=400,
            embedding_dim=16,
            n_topics=16,
            n_countries=30,
            regions_per_country=(2, 8),
            cities_per_region=(2, 10),
            neighbourhoods_per_city=(1, 4),
            ads_per_advertiser=12.0,
            nearby_cities_mean=3.0,
            history_len_median=12,
            history_len_max=48,
            candidates_per_user=512,
            chunk_ads=512,
            eligibility_users=200,
        ),
        WorldProfile(
            name="demo",
            n_ads=200_000,
            n_users=20_000,
            n_topics=48,
            n_countries=40,
            regions_per_country=(3, 24),
            cities_per_region=(3, 60),
            neighbourhoods_per_city=(1, 8),
            history_len_median=30,
            history_len_max=128,
            chunk_ads=65_536,
        ),
        # the paper's regime at a trainable size: the campaigns of one creative share its
        # content (one SID) and its market, but not their demographics; calibrated so that
        # a trained model's CD-only pass rate and GTM's lift are the paper's
        # (bench/calibrate_study.py, bench/study.sh)
        WorldProfile(
            name="study",
            n_ads=2_000_000,
            n_users=100_000,
            n_topics=96,
            # mostly regional / local advertisers: a market of one region or city is not
            # among the model's features (country, age, gender), only in the history
            style_mix=(0.15, 0.05, 0.50, 0.30),
            ads_per_creative=8.0,
            creative_noise=0.002,
            campaign_geo_share=0.95,
            campaign_demo_share=0.8,
            campaign_geo_by_creative=True,
            # 40 % of creatives launched after the log: no model trained on it has seen
            # where they may run, as with a production catalog's new campaigns
            fresh_share=0.4,
        ),
        WorldProfile(name="paper", n_ads=30_000_000, n_users=100_000, n_topics=128),
    )
}


def _parse_knob(knob: str, text: str, like: object) -> object:
    """`text` as a value of the kind of `like` (the knob's current value)."""
    try:
        if isinstance(like, bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "1")
        if isinstance(like, tuple):
            parts = tuple(type(like[0])(v) for v in text.split(","))
            if len(parts) != len(like):
                raise ValueError
            return parts
        return type(like)(text)
    except ValueError:
        kind = type(like).__name__
        if isinstance(like, tuple):
            kind = f"{len(like)} comma-separated numbers"
        raise ValueError(f"knob {knob}: {text!r} is not {kind} (now {like!r})") from None


def stream(seed: int, name: str, *index: int) -> np.random.Generator:
    """An independent, reproducible random stream for one stage (and chunk) of a world."""
    return np.random.default_rng([seed, zlib.crc32(name.encode()), *index])
