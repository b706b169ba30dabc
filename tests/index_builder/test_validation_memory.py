"""Peak memory of `validate_index` alone (issue #48): the builder validates every index it
publishes (`index_builder/build.py` -> `index_builder/publish.py` ->
`contracts/index_validation.py`) after freeing its own arrays, so validation's peak is part
of the build's. It checks blocks of ads, leaves and trie entries at a time and lets go of
the memory-mapped pages it has read; whole-array temporaries (per-ad Bloom rows, int64
parent arrays, a resident copy of every file read) held ~440 bytes per ad here before.

The index is built here (a Parquet catalog -> `build_index`); the validation runs in a
fresh process (tests/helpers/peak_memory.py), as
`validate_index`'s callers run it: memory-mapped, with the builder's expectations. A second
test checks that blocks of any size give the faults one block gives.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from contracts import index_validation
from contracts.index_validation import IndexValidationError, validate_index
from index_builder.build import build_index
from index_builder.publish import current_path
from tests.helpers.indexes import rewrite_array
from tests.helpers.peak_memory import CAN_RESET, peak_bytes_per_ad, write_catalog

ADS = 300_000
BOUND = 200  # bytes of validate_index's own peak RSS per ad (blocks: ~100; before: ~440)

_SETUP = "from contracts.index_validation import validate_index"
_CALL = "validate_index(Path(arg)).arrays.ads.num_ads"


def _build(root: Path, ads: int) -> Path:
    """`ads` ads through `build_index` (tests/helpers/peak_memory.py's catalog); the
    published version's directory."""
    write_catalog(root, ads)
    build_index(root / "catalog.parquet", root / "out", tokenizer_path=root / "tok",
                progress=False, workers=2)  # fmt: skip
    version = current_path(root / "out")
    assert version is not None
    return version


@pytest.mark.skipif(not CAN_RESET, reason="Linux /proc figures")
def test_validate_index_peak_memory_per_ad(tmp_path: Path) -> None:
    per_ad = peak_bytes_per_ad(_SETUP, _CALL, _build(tmp_path, ADS), ADS)
    assert per_ad < BOUND, f"validate_index peaked at {per_ad:.0f} bytes per ad (bound {BOUND})"


def _faults(version: Path) -> list[str]:
    try:
        validate_index(version)
    except IndexValidationError as exc:
        return exc.faults
    return []


def _swap_last(a: np.ndarray) -> np.ndarray:
    b = a.copy()
    b[[-1, -2]] = b[[-2, -1]]
    return b


def _clear_row(a: np.ndarray, row: int) -> np.ndarray:
    b = a.copy()
    b[row] = 0
    return b


def _repeat_last_sibling(version: Path) -> np.ndarray:
    """csr_tokens with the last token that has an elder sibling set to that sibling's."""
    tokens = np.load(version / "trie.csr_tokens.npy")
    starts = np.load(version / "trie.node_offsets.npy")
    later = np.setdiff1d(np.arange(1, len(tokens)), starts)  # entries after a sibling
    tokens[later[-1]] = tokens[later[-1] - 1]
    return tokens


def _last_inner_past_next(version: Path) -> np.ndarray:
    """node_offsets with the last inner node's start past the next node's."""
    offsets = np.load(version / "trie.node_offsets.npy")
    last_inner = int(np.load(version / "trie.level_offsets.npy")[-2]) - 1
    offsets[last_inner] = offsets[last_inner + 1] + 1
    return offsets


def _last_list_reversed(version: Path) -> np.ndarray:
    """ad_loc_ids with the last list of two or more ids reversed."""
    ids = np.load(version / "ads.ad_loc_ids.npy")
    offsets = np.load(version / "ads.ad_loc_offsets.npy")
    last = np.flatnonzero(np.diff(offsets) > 1)[-1]
    ids[offsets[last] : offsets[last + 1]] = ids[offsets[last] : offsets[last + 1]][::-1]
    return ids


def _loaded(name: str, mutate: Callable[[np.ndarray], np.ndarray]) -> Corruption:
    return name, lambda version: mutate(np.load(version / f"{name}.npy"))


Corruption = tuple[str, Callable[[Path], np.ndarray]]
CORRUPTIONS: dict[str, Corruption] = {
    "tokens": ("trie.csr_tokens", _repeat_last_sibling),
    "node-offsets": ("trie.node_offsets", _last_inner_past_next),
    "child-nodes": _loaded("trie.csr_child_nodes", _swap_last),
    "bloom-table": _loaded("trie.bloom_table", lambda a: _clear_row(a, len(a) - 1)),
    "bitmask-table": _loaded("trie.bitmask_table", lambda a: _clear_row(a, len(a) - 1)),
    "ad-ids": _loaded("ads.ad_ids", lambda a: np.r_[a[:-1], a[:1]]),
    "leaf-sids": _loaded("ads.leaf_sids", _swap_last),
    "leaf-offsets": _loaded("ads.leaf_ad_offsets", lambda a: np.r_[a[:-2], a[-3], a[-1]]),
    "sets-order": ("ads.ad_loc_ids", _last_list_reversed),
}


@pytest.fixture(scope="module")
def mid_index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory.mktemp("blocks"), 3_000)


@pytest.mark.parametrize("corruption", ["sound", *CORRUPTIONS])
def test_blocks_of_any_size_find_the_faults_one_block_finds(
    mid_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, corruption: str
) -> None:
    """Faults near the end of the arrays (the last block) and checks across block
    boundaries: blocks of 1, 7 and 1000 (and ad-id buckets of 64) report exactly what
    one block for the whole index reports."""
    version = tmp_path / mid_index.name
    version.mkdir()
    for f in mid_index.iterdir():
        (version / f.name).write_bytes(f.read_bytes())
    if corruption != "sound":
        name, corrupted = CORRUPTIONS[corruption]
        rewrite_array(version, name, corrupted(version))
    monkeypatch.setattr(index_validation, "BLOCK", 1 << 30)
    monkeypatch.setattr(index_validation, "ID_BUCKET", 1 << 30)
    whole = _faults(version)
    assert bool(whole) == (corruption != "sound")
    for block, bucket in ((1, 64), (7, 64), (1000, 1 << 30)):
        monkeypatch.setattr(index_validation, "BLOCK", block)
        monkeypatch.setattr(index_validation, "ID_BUCKET", bucket)
        assert _faults(version) == whole, (block, bucket)
