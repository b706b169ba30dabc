"""GTM over K >= 0 Bloom families (a targeting schema's `set` attributes): the kernel and
the reference allow exactly what the rule allows — the bitmask, then ANY of the request's
rows of each family, ALL families — for families of different widths, padding rows and
random tables; and on a schema-encoded catalog nothing eligible is ever barred.

The rule is computed here in numpy, entry by entry, straight from its statement; the
kernel runs under TRITON_INTERPRET=1 on CPU (tests/conftest.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contracts.index_format import VOCAB_SIZE
from contracts.request import FilterMode
from contracts.targeting import Targeting
from contracts.targeting_codec import (
    AdRules,
    EncodedRequests,
    Ragged,
    RequestRules,
    blooms_pass,
    codec,
    contains,
    exact_eligible,
    value_blooms,
)
from contracts.targeting_schema import DEFAULT, Attribute, TargetingSchema
from contracts.tensors import GtmTables, RequestTensors
from kernels.gtm_mask import gtm_mask_triton, lookup
from tests.kernels.test_gtm_mask import (
    CONFIGS,
    DEV,
    MID,
    TINY,
    assert_candidates,
    reference,
    run_kernel,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:divide by zero encountered in log:RuntimeWarning",
    "ignore:invalid value encountered in subtract:RuntimeWarning",
)
needs_triton = pytest.mark.skipif(gtm_mask_triton is None, reason="triton is not installed")
CD_GTM = FilterMode.CD_GTM
ONES = np.iinfo(np.uint64).max
# families' widths in words (64, 128, 256, 512 bits; 1024 loops over its words at run time)
WIDTHS = [(), (4,), (1,), (8, 2), (2, 8, 1), (4, 1, 8), (16, 2)]


def _u64(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int64)).to(DEV)


def _i32(a) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a, dtype=np.int32)).to(DEV)


@dataclass
class Trie:
    """A CSR trie with one matcher row per entry id (numpy, uint64 tables)."""

    offsets: np.ndarray  # int [num_nodes + 1]
    tokens: np.ndarray  # int [E]
    children: np.ndarray  # int [E]
    bm_index: np.ndarray  # int [E]
    bl_index: np.ndarray  # int [E]
    bm_table: np.ndarray  # uint64 [R_bm, W_bm]
    bl_table: np.ndarray  # uint64 [R_bl, W_bl]

    def tables(self, families: tuple[tuple[int, int], ...] | None) -> GtmTables:
        return GtmTables(
            node_offsets=_i32(self.offsets), child_nodes=_i32(self.children),
            tokens=_i32(self.tokens), bitmask_index=_i32(self.bm_index),
            bloom_index=_i32(self.bl_index), bitmask_table=_u64(self.bm_table),
            bloom_table=_u64(self.bl_table), bloom_families=families,
        )  # fmt: skip


def rule_mask(trie: Trie, nodes, rows_request, passes) -> tuple[np.ndarray, np.ndarray]:
    """(allowed bool [R, V], child int32 [R, V]): every entry of each row's node where
    `passes(bitmask_matcher, bloom_matcher, request)`."""
    allowed = np.zeros((len(nodes), VOCAB_SIZE), dtype=bool)
    child = np.full((len(nodes), VOCAB_SIZE), -1, dtype=np.int32)
    for r, (node, b) in enumerate(zip(nodes, rows_request, strict=True)):
        for e in range(trie.offsets[node], trie.offsets[node + 1]):
            if passes(trie.bm_table[trie.bm_index[e]], trie.bl_table[trie.bl_index[e]], b):
                allowed[r, trie.tokens[e]] = True
                child[r, trie.tokens[e]] = trie.children[e]
    return allowed, child


def _bits(rng: np.random.Generator, n: int, words: int, k: int) -> np.ndarray:
    """n rows of `words` words with k random bits set each (a value's Bloom hashes)."""
    out = np.zeros((n, words), dtype=np.uint64)
    for i in range(n):
        for b in rng.integers(0, 64 * words, size=k):
            out[i, b // 64] |= np.uint64(1) << np.uint64(b % 64)
    return out


def random_case(seed: int, widths: tuple[int, ...], zero_padding: bool = False):
    """Random requests, then a random two-level trie whose matchers mix all-ones families,
    ORs of some request rows (hits) and random bits (mostly misses). Padding rows repeat
    each family's row 0 (the contract) or, with `zero_padding`, are zeros: contained in
    every matcher, so reading one would allow what the rule bars."""
    rng = np.random.default_rng(seed)
    at = np.cumsum((0, *widths))
    families = tuple((int(a), w) for a, w in zip(at[:-1], widths, strict=True))
    n_req, w_bm, w_bl, k = 4, int(rng.integers(1, 6)), int(at[-1]), len(widths)
    req_bm = np.zeros((n_req, w_bm), dtype=np.uint64)
    for b in range(n_req):  # about one bit per attribute, some words empty
        for w in rng.choice(w_bm, size=int(rng.integers(0, w_bm + 1)), replace=False):
            req_bm[b, w] = np.uint64(1) << np.uint64(rng.integers(64))
    n_blooms = rng.integers(1, 12, size=(n_req, k)).astype(np.int32)
    n_blooms[rng.random((n_req, k)) < 0.15] = 1  # a request without values: the sentinel
    blooms = np.zeros((n_req, max(1, int(n_blooms.max(initial=1))), w_bl), dtype=np.uint64)
    for b in range(n_req):
        for f, (a, w) in enumerate(families):
            n = n_blooms[b, f]
            sentinel = n == 1 and rng.random() < 0.3
            rows = np.full((1, w), ONES, dtype=np.uint64) if sentinel else _bits(rng, n, w, 3)
            blooms[b, :n, a : a + w] = rows
            blooms[b, n:, a : a + w] = 0 if zero_padding else rows[0]

    bm_table = req_bm[rng.integers(0, n_req, 40)] | _bits(rng, 40, w_bm, 40)
    bm_table[::3] = _bits(rng, len(bm_table[::3]), w_bm, 48)  # mostly fail
    bl_table = np.zeros((60, w_bl), dtype=np.uint64)
    for j in range(len(bl_table)):
        for f, (a, w) in enumerate(families):
            kind = rng.random()
            if kind < 0.15:
                bl_table[j, a : a + w] = ONES
            elif kind < 0.6:  # contains 1-3 rows of random requests, within their counts
                for b in rng.integers(0, n_req, size=int(rng.integers(1, 4))):
                    bl_table[j, a : a + w] |= blooms[b, rng.integers(n_blooms[b, f]), a : a + w]
                bl_table[j, a : a + w] |= _bits(rng, 1, w, 8)[0]
            else:
                bl_table[j, a : a + w] = _bits(rng, 1, w, 20 * w)[0]

    level1 = int(rng.integers(20, 60))  # the root's children; each has 0-5 leaves
    counts = np.concatenate([[level1], rng.integers(0, 6, size=level1)])
    leaves = int(counts[1:].sum())
    counts = np.concatenate([counts, np.zeros(leaves, dtype=np.int64)])
    offsets = np.concatenate([[0], np.cumsum(counts)])
    e = int(offsets[-1])
    tokens = np.concatenate([rng.choice(VOCAB_SIZE, size=c, replace=False) for c in counts])
    trie = Trie(
        offsets, tokens, np.arange(1, e + 1), rng.integers(0, len(bm_table), e),
        rng.integers(0, len(bl_table), e), bm_table, bl_table,
    )  # fmt: skip
    nodes = rng.integers(0, len(counts), size=14)
    nodes[:3] = 0  # the root's range spans many chunks
    nodes[3:8] = rng.integers(1, level1 + 1, size=5)
    request = rng.integers(0, n_req, size=len(nodes))
    enc = (req_bm, blooms, n_blooms)
    return trie, families, enc, nodes, request


def rule(families, enc):
    """The rule, literally: bitmask contained, and for every family ANY of its n rows."""
    req_bm, blooms, n_blooms = enc

    def passes(bm, bl, b) -> bool:
        ok = bool(np.all((bm & req_bm[b]) == req_bm[b]))
        for f, (a, w) in enumerate(families):
            rows = blooms[b, : n_blooms[b, f], a : a + w]
            ok = ok and bool(np.any(np.all((bl[a : a + w] & rows) == rows, axis=1)))
        return ok

    return passes


def tensors(enc, counted: bool) -> RequestTensors:
    req_bm, blooms, n_blooms = enc
    return RequestTensors(_u64(req_bm), _u64(blooms), _i32(n_blooms) if counted else None)


def _rows(nodes, request, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(nodes), VOCAB_SIZE, generator=g).to(DEV)
    score = (-torch.rand(len(nodes), generator=g) * 5).to(DEV)
    return logits, torch.as_tensor(nodes).to(DEV), torch.as_tensor(request).to(DEV), score


@needs_triton
@pytest.mark.parametrize("counted", [True, False], ids=["n_blooms", "all_rows"])
@pytest.mark.parametrize("widths", WIDTHS, ids=lambda w: "-".join(str(64 * x) for x in w) or "K0")
@pytest.mark.parametrize(
    ("seed", "config"), [(0, TINY), (1, MID), (2, MID)], ids=["tiny", "mid", "mid2"]
)
def test_kernel_and_reference_allow_exactly_the_rule(seed, widths, config, counted) -> None:
    """Families of 64 to 1,024 bits side by side, random row counts: the kernel's and the
    reference's allowed tokens and children are the rule's, and their candidates agree."""
    trie, families, enc, nodes, request = random_case(seed * 31 + len(widths), widths)
    tables, requests = trie.tables(families), tensors(enc, counted)
    want, want_child = rule_mask(trie, nodes, request, rule(families, enc))
    children = int(np.diff(trie.offsets)[nodes].sum())
    assert 0 < want.sum() < children, "all or nothing allowed: a vacuous comparison"
    logits, nodes_t, request_t, score = _rows(nodes, request, seed)
    args = (logits, tables, nodes_t, request_t, requests, CD_GTM, score)
    got = run_kernel(*args, config=config)
    assert np.array_equal(torch.isfinite(got[0]).cpu().numpy(), want)
    assert np.array_equal(got[1].cpu().numpy(), want_child)
    ref, ref_child = lookup(tables, nodes_t, request_t, requests, CD_GTM)
    assert np.array_equal(ref.cpu().numpy(), want)
    assert np.array_equal(ref_child.cpu().numpy(), want_child)
    assert_candidates(got, reference(*args))


@needs_triton
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("widths", [(4,), (2, 8, 1)], ids=["256", "128-512-64"])
def test_only_the_counted_rows_are_read(widths, config) -> None:
    """Zero padding rows (contained in every matcher) past each family's count: with
    n_blooms the kernel and the reference read none of them."""
    trie, families, enc, nodes, request = random_case(7, widths, zero_padding=True)
    tables, requests = trie.tables(families), tensors(enc, counted=True)
    want, _ = rule_mask(trie, nodes, request, rule(families, enc))
    logits, nodes_t, request_t, score = _rows(nodes, request, 7)
    got = run_kernel(logits, tables, nodes_t, request_t, requests, CD_GTM, score, config=config)
    assert np.array_equal(torch.isfinite(got[0]).cpu().numpy(), want)
    ref, _ = lookup(tables, nodes_t, request_t, requests, CD_GTM)
    assert np.array_equal(ref.cpu().numpy(), want)


def test_kway_reference_takes_any_partition_over_every_family() -> None:
    """k-way: an entry is allowed iff ANY of its partitions passes the bitmask and ALL
    families."""
    trie, families, enc, nodes, request = random_case(3, (1, 8, 2))
    rng = np.random.default_rng(3)
    e = len(trie.tokens)
    parts = rng.integers(1, 4, size=e)
    kway_offsets = np.concatenate([[0], np.cumsum(parts)])
    p_bm = rng.integers(0, len(trie.bm_table), size=int(kway_offsets[-1]))
    p_bl = rng.integers(0, len(trie.bl_table), size=int(kway_offsets[-1]))
    tables = GtmTables(
        **{k: getattr(trie.tables(families), k) for k in (
            "node_offsets", "child_nodes", "tokens", "bitmask_index", "bloom_index",
            "bitmask_table", "bloom_table")},
        kway_offsets=torch.as_tensor(kway_offsets).to(DEV),
        kway_bitmask=_u64(trie.bm_table[p_bm]), kway_bloom=_u64(trie.bl_table[p_bl]),
        bloom_families=families,
    )  # fmt: skip
    passes = rule(families, enc)
    want = np.zeros((len(nodes), VOCAB_SIZE), dtype=bool)
    for r, (node, b) in enumerate(zip(nodes, request, strict=True)):
        for j in range(trie.offsets[node], trie.offsets[node + 1]):
            want[r, trie.tokens[j]] = any(
                passes(trie.bm_table[p_bm[p]], trie.bl_table[p_bl[p]], b)
                for p in range(kway_offsets[j], kway_offsets[j + 1])
            )
    _, nodes_t, request_t, _ = _rows(nodes, request, 3)
    got, _ = lookup(tables, nodes_t, request_t, tensors(enc, True), FilterMode.CD_GTM_KWAY)
    assert want.any() and np.array_equal(got.cpu().numpy(), want)


def test_tables_resolve_and_check_the_family_layout() -> None:
    """Without a layout a Bloom row is one family (none when it has no words); a layout
    must tile the row's words in order."""
    trie, *_ = random_case(0, (4,))
    assert trie.tables(None).families == ((0, 4),)
    trie.bl_table = np.zeros((3, 0), dtype=np.uint64)
    assert trie.tables(None).families == ()
    trie.bl_table = np.zeros((3, 7), dtype=np.uint64)
    assert trie.tables(((0, 1), (1, 2), (3, 4))).families == ((0, 1), (1, 2), (3, 4))
    for bad in (((0, 4),), ((0, 1), (2, 2), (3, 4)), ((0, 1), (1, 2), (3, 0), (3, 4))):
        with pytest.raises(ValueError, match="Bloom families"):
            trie.tables(bad)


def test_requests_from_either_encoding() -> None:
    """Requests in the fixed layout's form, one family counted per request (n_blooms [B]),
    read as n_blooms [B, 1]; the schema codec's keep their [B, K] counts."""
    enc = codec(DEFAULT).encode_requests([Targeting(locations=("a", "b")).values(), {}])
    assert enc.n_blooms.tolist() == [[2], [1]]
    old = RequestTensors.from_encoded(EncodedRequests(enc.bitmask, enc.blooms, enc.n_blooms[:, 0]))
    assert old.n_blooms is not None and old.n_blooms.tolist() == [[2], [1]]
    assert old.n_blooms.dtype == torch.int32
    new = codec(SCHEMA).encode_requests([{"interests": ["x", "y", "z"]}, {}])
    got = RequestTensors.from_encoded(new)
    assert got.n_blooms is not None and got.n_blooms.tolist() == [[1, 3, 1], [1, 1, 1]]
    assert got.blooms.shape == (2, 3, SCHEMA.bloom_words)


@needs_triton
def test_launcher_rejects_counts_of_another_layout() -> None:
    trie, families, enc, nodes, request = random_case(0, (1, 8))
    logits, nodes_t, request_t, score = _rows(nodes, request, 0)
    bad = RequestTensors(_u64(enc[0]), _u64(enc[1]), _i32(enc[2][:, :1]))
    with pytest.raises(AssertionError, match="n_blooms"):
        gtm_mask_triton(logits, trie.tables(families), nodes_t, request_t, bad, score, gtm=True)


# --------------------------------------------------------------- a schema-encoded catalog

VOCAB = ("a", "b", "c", "d", "e", "f")
# fmt: off
SCHEMA = TargetingSchema(attributes=(
    Attribute(name="country", kind="enum", catalog_field="countries", values=("US", "CA", "GB")),
    Attribute(name="locations", kind="set", catalog_field="locations", bloom_bits=64),
    Attribute(name="age", kind="bucket", catalog_field="ages",
              buckets={"young": (13, 29), "old": (30, None)}),
    Attribute(name="interests", kind="set", catalog_field="interests", bloom_bits=512,
              bloom_hashes=2),
    Attribute(name="apps", kind="set", catalog_field="apps", bloom_bits=128),
))
# fmt: on


def _rule(values: int, most: int) -> st.SearchStrategy[list[int]]:
    """No rule half the time (else few ads would be eligible for anything)."""
    some = st.lists(st.integers(0, values - 1), min_size=1, max_size=most, unique=True)
    return st.one_of(st.just([]), some)


# per attribute (include, exclude) value indices; excluded set values are not in the Bloom
_ad = st.fixed_dictionaries(
    {a.name: st.tuples(_rule(len(VOCAB), 3), _rule(len(VOCAB), 2)) if a.kind == "set"
     else st.tuples(_rule(len(a.labels), 2), _rule(len(a.labels), 1))
     for a in SCHEMA.attributes}
)  # fmt: skip
_request = st.fixed_dictionaries(
    {},
    optional={
        "country": st.sampled_from(("US", "CA", "GB")).map(lambda v: [v]),
        "age": st.integers(0, 80).map(lambda v: [str(v)]),
        **{a.name: st.lists(st.sampled_from((*VOCAB, "zz")), max_size=5, unique=True)
           for a in SCHEMA.families},
    },
)  # fmt: skip


def catalog_trie(ads: list[dict], groups: int) -> tuple[Trie, AdRules, list[int]]:
    """Ads under `groups` group nodes of the root (ad i under group i % groups, root token
    7·g + 3, leaf token i): each root entry's matchers the OR of its group's ads, each
    leaf's its ad's own. Also each ad's leaf entry."""
    c, n = codec(SCHEMA), len(ads)
    include = {a.name: Ragged.from_lists([ad[a.name][0] for ad in ads]) for a in SCHEMA.attributes}
    exclude = {a.name: Ragged.from_lists([ad[a.name][1] for ad in ads]) for a in SCHEMA.attributes}
    vocabularies = {a.name: value_blooms(VOCAB, a.bloom_bits, a.bloom_hashes) for a in c.families}
    bm, bl = c.ad_bitmasks(include, exclude, n), c.ad_blooms(include, vocabularies, n)
    members = [list(range(g, n, groups)) for g in range(groups)]
    group_bm = np.stack([np.bitwise_or.reduce(bm[m], axis=0) for m in members])
    group_bl = np.stack([np.bitwise_or.reduce(bl[m], axis=0) for m in members])
    counts = [groups, *(len(m) for m in members), *([0] * n)]
    order = [i for m in members for i in m]  # leaf entries, group by group
    trie = Trie(
        offsets=np.concatenate([[0], np.cumsum(counts)]),
        tokens=np.array([*(7 * g + 3 for g in range(groups)), *(i % 512 for i in order)]),
        children=np.arange(1, groups + n + 1),
        bm_index=np.arange(groups + n), bl_index=np.arange(groups + n),
        bm_table=np.concatenate([group_bm, bm[order]]),
        bl_table=np.concatenate([group_bl, bl[order]]),
    )  # fmt: skip
    leaf = [groups + order.index(i) for i in range(n)]
    return trie, AdRules(bm, include, exclude), leaf


@needs_triton
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ads=st.lists(_ad, min_size=1, max_size=10),
    reqs=st.lists(_request, min_size=1, max_size=3),
    groups=st.integers(1, 3),
)
def test_schema_gtm_is_the_rule_and_never_bars_an_eligible_ad(ads, reqs, groups) -> None:
    """Three families (64, 512 and 128 bits) among enum and bucket bits, encoded by the
    codec: from the root and every group node the kernel allows exactly what the contract's
    own `contains` and `blooms_pass` allow, so every prefix of an exactly eligible ad."""
    c = codec(SCHEMA)
    trie, rules, leaf = catalog_trie(ads, groups := min(groups, len(ads)))
    enc = c.encode_requests(reqs)
    tables = trie.tables(SCHEMA.family_words)
    requests = RequestTensors.from_encoded(enc, DEV)
    inner = np.arange(groups + 1)
    nodes, request = np.tile(inner, len(reqs)), np.repeat(np.arange(len(reqs)), len(inner))
    rows = [c.request_blooms(v) for v in reqs]

    def passes(bm, bl, b) -> bool:
        return bool(contains(bm, enc.bitmask[b]) and blooms_pass(SCHEMA, bl[None], rows[b])[0])

    want, want_child = rule_mask(trie, nodes, request, passes)
    logits, nodes_t, request_t, score = _rows(nodes, request, 0)
    got = run_kernel(logits, tables, nodes_t, request_t, requests, CD_GTM, score, config=TINY)
    allowed = torch.isfinite(got[0]).cpu().numpy()
    assert np.array_equal(allowed, want)
    assert np.array_equal(got[1].cpu().numpy(), want_child)
    for b, values in enumerate(reqs):
        ids = {a.name: np.array([VOCAB.index(v) for v in values.get(a.name, ()) if v in VOCAB],
                                dtype=np.int32) for a in SCHEMA.families}  # fmt: skip
        eligible = exact_eligible(
            SCHEMA, np.arange(len(ads)), rules, RequestRules(enc.bitmask[b], ids)
        )
        for i in np.flatnonzero(eligible):
            g = i % groups
            root_row, group_row = b * len(inner), b * len(inner) + 1 + g
            assert allowed[root_row, 7 * g + 3], f"ad {i} barred at the root"
            assert allowed[group_row, trie.tokens[leaf[i]]], f"ad {i} barred below group {g}"
