"""How much of the catalog targeting lets through, measured on a sample (docs/SYNTH.md
"Eligibility calibration"): `mean_eligible_share` and `topk_affinity_pass_rate`, the
share of a user's top-affinity ads (targeting ignored) that are eligible, a proxy for
CD-only decoding's exact pass rate. Runs after histories; the figures go into world.json.
"""

from __future__ import annotations

import numpy as np

from index_builder.synth.ads import AdState, EncodedAds
from index_builder.synth.geography import Geography
from index_builder.synth.histories import eligible_for
from index_builder.synth.profiles import WorldProfile
from index_builder.synth.user_attributes import UserAttributes
from index_builder.synth.users import Users


def estimate_eligibility(
    p: WorldProfile,
    geo: Geography,
    ads: AdState,
    enc: EncodedAds,
    users: Users,
    rng: np.random.Generator,
    extra: UserAttributes | None = None,  # a world's extra attributes
) -> dict[str, float | int]:
    sample = np.sort(rng.choice(ads.n, size=min(ads.n, p.eligibility_ads), replace=False))
    who = rng.choice(users.n, size=min(users.n, p.eligibility_users), replace=False)
    encoded, advertiser = enc.take(sample), ads.advertiser[sample]
    emb = np.asarray(ads.embedding[sample])
    logpop = np.log(ads.popularity[sample])
    k = min(p.topk_for_pass_rate, len(sample))
    shares, passes = [], []
    for u in who:
        ok = eligible_for(users, u, geo, encoded, advertiser, extra)
        shares.append(ok.mean())
        score = p.affinity_beta * (emb @ users.interest[u]) + logpop
        top = np.argpartition(-score, k - 1)[:k]
        passes.append(ok[top].mean())
    s = np.asarray(shares)
    return {
        "mean_eligible_share": float(s.mean()),
        "p10_eligible_share": float(np.quantile(s, 0.1)),
        "p50_eligible_share": float(np.quantile(s, 0.5)),
        "p90_eligible_share": float(np.quantile(s, 0.9)),
        "topk_affinity_pass_rate": float(np.mean(passes)),
        "topk": int(k),
        "sample_users": len(who),
        "sample_ads": len(sample),
    }
