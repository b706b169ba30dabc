"""Full validation of one index version: what `grace validate-index` and the server's
hot-swap run before an index may serve (docs/ARCHITECTURE.md §3). Beyond
`format.read_index_dir` (manifest, checksums, dtypes, shapes, schema) it checks the CSR
trie invariants, the SID -> ad index, the exact targeting index, and the GTM soundness
invariant: every matcher contains the OR of its subtree's ads, so no eligible prefix can
be masked. The optional k-way groups are checked for structure only (docs/FORMAT.md says
why).

In the flow: the builder (`index_builder/build.py`, through `index_builder/publish.py`)
runs it on every version it writes before publishing it, and the server
(`service/index/loaded.py`, `service/rollout/`) before serving one. The builder runs it
at the end of a full build, so its own peak memory is part of the build's (issue #48):
every check is vectorised over blocks of BLOCK ads, leaves, trie entries or list ids
(`_blocks`), never over whole-array temporaries, so what it allocates beyond the
(memory-mapped) index does not grow with the index; the one exception is the ad-id
uniqueness check, which sorts at most about ID_BUCKET ids at a time (`_ids_unique`).
One module past the house's ~300 lines: the checks are the format's invariants, read
together with docs/FORMAT.md, and share the block helpers.
"""

from __future__ import annotations

import itertools
import mmap as _mmap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import numpy as np

from contracts.index_arrays import AdArrays, IndexArrays, PartitionArrays, SetArrays, TrieArrays
from contracts.index_format import SID_LENGTH, VOCAB_SIZE, read_index_dir
from contracts.index_manifest import IndexFormatError, manifest_schema
from contracts.targeting_codec import Ragged, codec, value_blooms
from contracts.targeting_schema import TargetingSchema

BLOCK = 1 << 16  # ads, leaves, trie entries or ids checked at once (temporaries ~MBs)
ID_BUCKET = 1 << 25  # ad ids sorted at once by the uniqueness check (256 MB of int64)


class IndexValidationError(ValueError):
    """An index that must not serve; the message lists every fault found."""

    def __init__(self, path: Path, faults: list[str]) -> None:
        super().__init__(f"{path}: invalid index:\n  - " + "\n  - ".join(faults))
        self.path, self.faults = path, faults

    @property
    def summary(self) -> str:
        """The faults on one line, for logs."""
        return f"{self.path}: invalid index: " + "; ".join(self.faults)


@dataclass(frozen=True)
class ValidatedIndex:
    path: Path
    manifest: dict[str, Any]
    arrays: IndexArrays


def validate_index(
    path: Path | str,
    *,
    expect_tokenizer: str | None = None,
    expect_version: str | None = None,
    mmap: bool = True,
) -> ValidatedIndex:
    """Open and check an index directory; raise IndexValidationError listing all faults.
    `expect_tokenizer`: the SID space the index must be built for; `expect_version`: the
    version name it is published under; `mmap`: see `read_index_dir`."""
    path = Path(path)
    try:
        manifest, arrays = read_index_dir(path, mmap=mmap)
    except IndexFormatError as exc:
        raise IndexValidationError(path, [str(exc)]) from exc
    faults: list[str] = []
    if expect_version is not None and manifest["index_version"] != expect_version:
        faults.append(
            f"manifest index_version {manifest['index_version']!r} differs from the "
            f"version name {expect_version!r}"
        )
    if expect_tokenizer is not None and manifest["tokenizer_fingerprint"] != expect_tokenizer:
        faults.append(
            f"built for SID space {manifest['tokenizer_fingerprint']}, "
            f"the model's is {expect_tokenizer} (contracts/sid_space.py)"
        )
    schema = manifest_schema(manifest, path)  # read_index_dir has parsed it once already
    faults += check_trie(arrays.trie, schema)
    if not faults:  # the rest indexes through the trie
        faults += check_ads(arrays.trie, arrays.ads)
    if not faults:
        faults += check_soundness(arrays.trie, arrays.ads, schema)
    if not faults and arrays.kway is not None:
        faults += check_partitions(arrays.trie, arrays.kway)
    counts = manifest.get("counts", {})
    for key, actual in (("ads", arrays.ads.num_ads), ("nodes", arrays.trie.num_nodes)):
        if key in counts and counts[key] != actual:
            faults.append(f"manifest counts {key}={counts[key]}, arrays hold {actual}")
    _drop_pages(*_all_arrays(arrays))
    if faults:
        raise IndexValidationError(path, faults)
    return ValidatedIndex(path, manifest, arrays)


def _all_arrays(arrays: IndexArrays) -> list[np.ndarray | None]:
    """Every array of the index (None where an optional one is absent)."""
    groups: list[Any] = [arrays.trie, arrays.ads, *arrays.ads.sets.values(), arrays.kway]
    return [getattr(g, f.name) for g in groups if g is not None for f in fields(g)
            if f.name != "sets"]  # fmt: skip


# --- blocks ------------------------------------------------------------------------------


def _blocks(
    total: int, size: int | None = None, *, drop: Iterable[np.ndarray | None] = ()
) -> Iterator[tuple[int, int]]:
    """[lo, hi) ranges of at most `size` (BLOCK) covering range(total), in order; after
    each block the pages of the memory-mapped arrays in `drop` are let go (`_drop_pages`),
    so what the checks read of the index stays resident a block at a time."""
    size = BLOCK if size is None else size
    drop = tuple(drop)
    for lo in range(0, total, size):
        yield lo, min(lo + size, total)
        _drop_pages(*drop)


_DONTNEED: int | None = getattr(_mmap, "MADV_DONTNEED", None)


def _drop_pages(*arrays: np.ndarray | None) -> None:
    """Unmap the pages this process has read of each read-only memory-mapped array (the
    whole mapping; others are left alone). Their data stays in the page cache and in the
    file: a later read maps the same bytes again. Without it every page the checks read
    would stay in the process's RSS, the size of the index on disk (~110 bytes per ad)."""
    if _DONTNEED is None:
        return
    for arr in arrays:
        mapping = getattr(arr, "_mmap", None)
        if isinstance(arr, np.memmap) and arr.mode == "r" and isinstance(mapping, _mmap.mmap):
            mapping.madvise(_DONTNEED)


def _search(sorted_: np.ndarray, value: int, side: Literal["left", "right"]) -> int:
    """np.searchsorted of one int in an integer array, in the array's own dtype (a Python
    int would have numpy cast the whole array first: milliseconds a call on a large one)."""
    info = np.iinfo(sorted_.dtype)
    if value > info.max:
        return len(sorted_)
    if value < info.min:
        return 0
    return int(np.searchsorted(sorted_, sorted_.dtype.type(value), side=side))


def _entry_parents(node_offsets: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """int64 parent node of each entry in [lo, hi): what np.repeat(np.arange(nodes),
    np.diff(node_offsets))[lo:hi] holds, without the whole array (offsets monotone, from 0
    to the entry count)."""
    if hi <= lo:
        return np.zeros(0, dtype=np.int64)
    first = _search(node_offsets, lo, "right") - 1
    stop = _search(node_offsets, hi - 1, "right")  # past the last's parent
    bounds = np.clip(np.asarray(node_offsets[first : stop + 1], dtype=np.int64), lo, hi)
    return np.repeat(np.arange(first, stop, dtype=np.int64), np.diff(bounds))


def _monotone_offsets(name: str, off: np.ndarray, total: int) -> list[str]:
    if len(off) == 0 or off[0] != 0 or off[-1] != total:
        return [f"{name} must start at 0 and end at {total}"]
    for lo, hi in _blocks(len(off) - 1, drop=[off]):
        falls = np.diff(off[lo : hi + 1]) < 0  # pairs (j, j + 1) for j in [lo, hi)
        if falls.any():
            return [f"{name} decreases at {lo + int(np.argmax(falls))}"]
    return []


def _any_empty(off: np.ndarray) -> bool:
    """Whether some CSR list [off[i], off[i + 1]) is empty."""
    blocks = _blocks(len(off) - 1, drop=[off])
    return any(np.any(np.diff(off[lo : hi + 1]) == 0) for lo, hi in blocks)


def _in_range(name: str, a: np.ndarray, hi: int, lo: int = 0) -> list[str]:
    for b0, b1 in _blocks(len(a), drop=[a]):
        if a[b0:b1].min() < lo or a[b0:b1].max() >= hi:
            return [f"{name} out of range [{lo}, {hi})"]
    return []


# --- trie --------------------------------------------------------------------------------


def check_trie(t: TrieArrays, schema: TargetingSchema) -> list[str]:
    """CSR shape, breadth-first numbering, one level per edge, children exactly on inner
    nodes, tokens strictly increasing within a node, no bitmask padding bits."""
    faults: list[str] = []
    n, e = t.num_nodes, t.num_entries
    lo = t.level_offsets
    if len(lo) != SID_LENGTH + 2 or lo[0] != 0 or lo[1] != 1 or lo[-1] != n:
        return [f"level_offsets {lo.tolist()} do not describe {n} nodes in {SID_LENGTH} levels"]
    if np.any(np.diff(lo) <= 0):
        return [f"level_offsets {lo.tolist()} have an empty level"]
    faults += _monotone_offsets("node_offsets", t.node_offsets, e)
    if e != n - 1 or len(t.csr_child_nodes) != e:
        faults.append(f"{e} child entries for {n} nodes (a tree has nodes - 1)")
    if len(t.bitmask_index) != e or len(t.bloom_index) != e:
        faults.append("bitmask_index / bloom_index length differs from the child entries")
    if faults:
        return faults
    faults += _in_range("csr_tokens", t.csr_tokens, VOCAB_SIZE)
    faults += _in_range("bitmask_index", t.bitmask_index, len(t.bitmask_table))
    faults += _in_range("bloom_index", t.bloom_index, len(t.bloom_table))
    if not _breadth_first(t.csr_child_nodes):
        faults.append("csr_child_nodes is not the breadth-first numbering 1..nodes-1")
    if faults:
        return faults
    levels = np.asarray(lo, dtype=np.int64)
    skips = unsorted = False
    # entry j leads to node j + 1; a block [a, b) checks the token pairs (j, j + 1), j < b
    for a, b in _blocks(e, drop=[t.node_offsets, t.csr_tokens]):
        parent = _entry_parents(t.node_offsets, a, min(b + 1, e))
        depth_child = np.searchsorted(levels, np.arange(a + 1, b + 1), side="right") - 1
        depth_parent = np.searchsorted(levels, parent[: b - a], side="right") - 1
        skips = skips or bool(np.any(depth_child != depth_parent + 1))
        same_parent = parent[1:] == parent[:-1]
        tokens = t.csr_tokens[a : a + len(parent)]
        unsorted = unsorted or bool(np.any(same_parent & (tokens[1:] <= tokens[:-1])))
    if skips:
        faults.append("a child entry skips or repeats a level")
    leaves = int(levels[SID_LENGTH])  # depth SID_LENGTH: nodes [leaves, n)
    if _any_children(t.node_offsets, leaves, n, want=True):
        faults.append("a leaf (full SID) has children")
    if _any_children(t.node_offsets, 0, leaves, want=False):
        faults.append("an inner node has no children (a prefix of no SID)")
    if unsorted:
        faults.append("tokens within a node are not strictly increasing")
    full = codec(schema).full_bitmask
    if any(np.any(t.bitmask_table[a:b] & ~full) for a, b in _blocks(len(t.bitmask_table))):
        faults.append(f"bitmask rows set padding bits beyond bit {schema.bitmask_bits}")
    return faults


def _breadth_first(child_nodes: np.ndarray) -> bool:
    """Whether entry j leads to node j + 1 for every j."""
    return all(
        np.array_equal(child_nodes[a:b], np.arange(a + 1, b + 1, dtype=np.int32))
        for a, b in _blocks(len(child_nodes), drop=[child_nodes])
    )


def _any_children(node_offsets: np.ndarray, first: int, stop: int, *, want: bool) -> bool:
    """Whether some node in [first, stop) has children (`want`) / has none (not `want`)."""
    for a, b in _blocks(stop - first, drop=[node_offsets]):
        has = np.diff(node_offsets[first + a : first + b + 1]) > 0
        if np.any(has if want else ~has):
            return True
    return False


# --- ads ---------------------------------------------------------------------------------


def check_ads(t: TrieArrays, a: AdArrays) -> list[str]:
    """The SID -> ad index (leaf SIDs on the trie paths, offsets, unique ad ids) and the
    exact targeting index's shapes and set lists."""
    faults: list[str] = []
    num_leaves = int(t.level_offsets[-1] - t.level_offsets[-2])
    n = a.num_ads
    if a.leaf_sids.shape != (num_leaves, SID_LENGTH):
        return [f"leaf_sids has shape {a.leaf_sids.shape}, the trie has {num_leaves} leaves"]
    faults += _monotone_offsets("leaf_ad_offsets", a.leaf_ad_offsets, n)
    if len(a.leaf_ad_offsets) != num_leaves + 1:
        faults.append("leaf_ad_offsets length differs from leaves + 1")
    elif not faults and _any_empty(a.leaf_ad_offsets):
        faults.append("a SID maps to no ad")
    if not _ids_unique(a.ad_ids):
        faults.append("ad_ids are not unique")
    if a.ad_bitmask.shape[0] != n:
        faults.append("ad_bitmask rows differ from the number of ads")
    if a.ad_exclude_bitmask is not None and a.ad_exclude_bitmask.shape != a.ad_bitmask.shape:
        faults.append("ad_exclude_bitmask differs in shape from ad_bitmask")
    for name in ("ad_campaign_ids", "ad_advertiser_ids"):
        owners = getattr(a, name)
        if owners is not None and owners.shape != (n,):
            faults.append(f"{name} has {len(owners)} entries for {n} ads")
    for attr, sets in a.sets.items():
        faults += _check_set(f"sets.{attr}", sets, n)
    if faults:
        return faults
    # the SID on every leaf equals the token path from the root (the trie is sound here:
    # the parents of a range of nodes are a range of nodes), checked a block of leaves at
    # path, the last token first; the fault names the last token any leaf gets wrong
    first_leaf, wrong = int(t.level_offsets[-2]), -1
    for b0, b1 in _blocks(num_leaves, drop=[t.node_offsets, t.csr_tokens, a.leaf_sids]):
        node = np.arange(first_leaf + b0, first_leaf + b1, dtype=np.int64)
        for pos in range(SID_LENGTH - 1, wrong, -1):
            tokens = np.where(node > 0, t.csr_tokens[np.maximum(node, 1) - 1], 0)
            if np.any(tokens != a.leaf_sids[b0:b1, pos]):
                wrong = pos
                break
            node = _node_parents(t.node_offsets, node)
    if wrong >= 0:
        faults.append(f"leaf_sids disagree with the trie path at token {wrong}")
    return faults


def _node_parents(node_offsets: np.ndarray, node: np.ndarray) -> np.ndarray:
    """The parent of each of `node` (ascending, no gaps between distinct values; the root
    is its own parent, as in `check_ads`'s path walk)."""
    if len(node) == 0:
        return node
    first, last = int(node[0]), int(node[-1])
    parents = np.concatenate([[0], _entry_parents(node_offsets, max(first, 1) - 1, last)])
    return parents[node - max(first - 1, 0) if first > 0 else node]


def _ids_unique(ids: np.ndarray) -> bool:
    """Whether no id repeats: sorted (not np.unique: it hashes, ~100x slower on the
    builder's order) ID_BUCKET at a time, between splitters drawn from a sample, so equal
    ids always fall into the same bucket."""
    n = len(ids)
    if n <= ID_BUCKET:
        s = np.empty(n, dtype=ids.dtype)
        for a, b in _blocks(n, drop=[ids]):  # not np.sort(ids): every page of a map stays
            s[a:b] = ids[a:b]
        s.sort()
        return not np.any(s[1:] == s[:-1])
    buckets = 2 * -(-n // ID_BUCKET)  # twice the minimum: room for the sample's error
    sample = np.sort(ids[:: max(1, n // (buckets * 256))])
    splitters = np.unique(sample[np.linspace(0, len(sample), buckets + 1, dtype=np.int64)[1:-1]])
    bounds: list[tuple[Any, Any]] = list(itertools.pairwise([None, *splitters.tolist(), None]))
    for low, high in bounds:  # [low, high), open-ended at None
        parts = []
        for a, b in _blocks(n, ID_BUCKET, drop=[ids]):
            x = np.asarray(ids[a:b])
            keep = np.ones(len(x), dtype=bool)
            if low is not None:
                keep &= x >= low
            if high is not None:
                keep &= x < high
            parts.append(x[keep])
        s = np.sort(np.concatenate(parts))
        del parts
        if np.any(s[1:] == s[:-1]):
            return False
    return True


def _check_set(name: str, s: SetArrays, n: int) -> list[str]:
    """One set attribute's lists and vocabulary."""
    vocab = len(s.vocab_offsets) - 1
    faults = _monotone_offsets(f"{name}.vocab_offsets", s.vocab_offsets, len(s.vocab_bytes))
    lists = [("include", s.include_offsets, s.include_ids)]
    if s.exclude_offsets is not None and s.exclude_ids is not None:
        lists.append(("exclude", s.exclude_offsets, s.exclude_ids))
    for kind, offsets, ids in lists:
        faults += _monotone_offsets(f"{name}.{kind}_offsets", offsets, len(ids))
        if len(offsets) != n + 1:
            faults.append(f"{name}.{kind}_offsets length differs from ads + 1")
        faults += _in_range(f"{name}.{kind}_ids", ids, vocab)
    if faults:
        return faults
    for kind, offsets, ids in lists:  # the post stage intersects each ad's list by merge
        if not _ascending_per_list(offsets, ids):
            faults.append(f"{name}.{kind}_ids are not sorted ascending within each ad")
    try:
        strings = s.strings()
    except UnicodeDecodeError:
        return [f"{name}: the vocabulary is not valid UTF-8"]
    if any(x >= y for x, y in itertools.pairwise(strings)):
        faults.append(f"{name}: the vocabulary is not sorted and unique")
    return faults


def _ascending_per_list(offsets: np.ndarray, ids: np.ndarray) -> bool:
    """Whether each CSR list (offsets monotone and complete, ids in range) is sorted."""
    for a, b in _blocks(len(ids) - 1, drop=[ids, offsets]):  # pairs (j, j + 1), j in [a, b)
        rises = np.diff(ids[a : b + 1]) >= 0  # ids are in range, so no overflow
        if rises.all():
            continue
        first = _search(offsets, a + 1, "left")  # lists starting in
        stop = _search(offsets, b, "right")  # [a + 1, b]
        for c, d in _blocks(stop - first):  # pairs across two lists
            rises[np.asarray(offsets[first + c : first + d]) - (a + 1)] = True
        if not rises.all():
            return False
    return True


# --- soundness ---------------------------------------------------------------------------


def check_soundness(t: TrieArrays, a: AdArrays, schema: TargetingSchema) -> list[str]:
    """Every matcher contains the OR of its subtree's ads (so no false negatives): leaf
    matchers against the exact ad targeting (Bloom rows rehashed from each set attribute's
    value strings), a block of leaves' ads at a time; inner ones against their children
    where parent and child point at different table rows (most entries share their
    parent's row: a fraction of the rows is read), a block of entries at a time."""
    faults: list[str] = []
    ad_codec = codec(schema)
    vocab = {f.name: value_blooms(a.sets[f.name].strings(), f.bloom_bits, f.bloom_hashes)
             for f in schema.families}  # fmt: skip
    first_leaf_entry = int(t.level_offsets[-2]) - 1
    bm_missing = bl_missing = False
    read = [a.leaf_ad_offsets, a.ad_bitmask, t.bitmask_index, t.bloom_index]
    read += [x for s in a.sets.values() for x in (s.include_offsets, s.include_ids)]
    for l0, l1 in _leaf_blocks(a.leaf_ad_offsets, drop=read):
        offsets = np.asarray(a.leaf_ad_offsets[l0 : l1 + 1], dtype=np.int64)
        s0, s1 = int(offsets[0]), int(offsets[-1])
        starts = offsets[:-1] - s0
        leaf_bm = np.bitwise_or.reduceat(a.ad_bitmask[s0:s1], starts, axis=0)
        include = {name: _ragged_slice(s.include, s0, s1) for name, s in a.sets.items()}
        ads_bl = ad_codec.ad_blooms(include, vocab, s1 - s0)
        leaf_bl = np.bitwise_or.reduceat(ads_bl, starts, axis=0)
        del ads_bl
        entries = slice(first_leaf_entry + l0, first_leaf_entry + l1)
        bm_missing = bm_missing or not _contains(t.bitmask_table, t.bitmask_index[entries], leaf_bm)
        bl_missing = bl_missing or not _contains(t.bloom_table, t.bloom_index[entries], leaf_bl)
    if bm_missing:
        faults.append("a SID's bitmask matcher misses bits of its ads (false negatives)")
    if bl_missing:
        faults.append("a SID's Bloom matcher misses bits of its ads (false negatives)")
    for what, table, index in (("bitmask", t.bitmask_table, t.bitmask_index),
                               ("Bloom", t.bloom_table, t.bloom_index)):  # fmt: skip
        if not all(_prefixes_contain(t.node_offsets, table, index, e0, e1)
                   for e0, e1 in _blocks(t.num_entries, drop=[t.node_offsets, index])):  # fmt: skip
            faults.append(f"a prefix's {what} matcher misses bits of a child (false negatives)")
    return faults


def _leaf_blocks(
    leaf_ad_offsets: np.ndarray, *, drop: Iterable[np.ndarray | None] = ()
) -> Iterator[tuple[int, int]]:
    """[l0, l1) ranges of leaves covering all leaves, each with at most BLOCK leaves and
    about BLOCK ads (more only where one leaf alone holds more); `drop` as `_blocks`."""
    drop = tuple(drop)
    leaves = len(leaf_ad_offsets) - 1
    l0 = 0
    while l0 < leaves:
        limit = int(leaf_ad_offsets[l0]) + BLOCK
        l1 = _search(leaf_ad_offsets, limit, "right") - 1
        l1 = min(max(l1, l0 + 1), l0 + BLOCK, leaves)
        yield l0, l1
        _drop_pages(*drop)
        l0 = l1


def _ragged_slice(r: Ragged, lo: int, hi: int) -> Ragged:
    """Ads [lo, hi) of `r` as a Ragged of their own (values a view)."""
    offsets = np.asarray(r.offsets[lo : hi + 1], dtype=np.int64)
    return Ragged(offsets - offsets[0], r.values[int(offsets[0]) : int(offsets[-1])])


def _prefixes_contain(
    node_offsets: np.ndarray, table: np.ndarray, index: np.ndarray, lo: int, hi: int
) -> bool:
    """Whether each entry in [lo, hi) under another entry points at a row containing its
    own row's bits where the two rows differ."""
    parent = _entry_parents(node_offsets, lo, hi)
    inner = parent > 0  # entries whose parent is itself an entry (node p = entry p-1)
    child_row, parent_row = np.asarray(index[lo:hi])[inner], index[parent[inner] - 1]
    apart = child_row != parent_row
    return _contains(table, parent_row[apart], table[child_row[apart]])


def _contains(table: np.ndarray, rows: np.ndarray, bits: np.ndarray) -> bool:
    """Whether every `table[rows[i]]` holds all of `bits[i]`'s set bits."""
    return not np.any((table[rows] & bits) != bits)


# --- k-way -------------------------------------------------------------------------------


def check_partitions(t: TrieArrays, p: PartitionArrays) -> list[str]:
    """The k-way groups' structure: offsets, index lengths and ranges, no empty group."""
    faults = _monotone_offsets("kway.offsets", p.offsets, len(p.bitmask_index))
    if len(p.offsets) != t.num_entries + 1:
        faults.append("kway.offsets length differs from child entries + 1")
    if len(p.bloom_index) != len(p.bitmask_index):
        faults.append("kway bitmask/bloom index lengths differ")
    faults += _in_range("kway.bitmask_index", p.bitmask_index, len(p.bitmask_table))
    faults += _in_range("kway.bloom_index", p.bloom_index, len(p.bloom_table))
    if not faults and _any_empty(p.offsets):
        faults.append("a child entry has no k-way group")
    return faults
