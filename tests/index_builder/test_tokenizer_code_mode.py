"""SID tokenizer `last_token` modes: "code" (one more RQ-KMeans level, so ads of one creative
share a full SID) next to the default "rank", whose fingerprints, files and SIDs are pinned to
the values from before the option existed (docs/TOKENIZER.md "Last token: rank or code")."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from safetensors.numpy import save_file

from index_builder.kmeans import rq_encode
from index_builder.last_token import CollisionReport
from index_builder.tokenizer import SIDTokenizer, TokenizerConfig
from tests.helpers.collisions import reconstruct, reference_report

K = 16
CODE = TokenizerConfig(levels=2, codebook_size=K, iterations=10, last_token="code")
RANK = TokenizerConfig(levels=2, codebook_size=K, iterations=10)

# Pinned with the code from before `last_token` existed: a fixed tokenizer's fingerprint,
# its tokenizer.json and its SIDs for fixed embeddings.
PIN_CONFIG = TokenizerConfig(levels=3, codebook_size=4, iterations=5, train_sample=100, seed=3)
PIN_FINGERPRINT = "2cef043475a90b09"
PIN_DEFAULT_FINGERPRINT = "9ed7fdbda38aa0fb"  # TokenizerConfig(), zero codebooks [3, 512, 2]
PIN_META = """{
  "config": {
    "codebook_size": 4,
    "iterations": 5,
    "levels": 3,
    "seed": 3,
    "train_sample": 100
  },
  "dim": 4,
  "fingerprint": "2cef043475a90b09",
  "format_version": 1,
  "kind": "grace.sid_tokenizer"
}"""
PIN_SIDS = [
    [3, 3, 0, 1], [3, 3, 1, 0], [3, 2, 0, 0], [1, 2, 0, 0], [3, 3, 0, 2], [3, 3, 0, 0],
    [3, 3, 0, 2], [3, 3, 0, 1], [3, 3, 0, 0], [3, 3, 0, 3], [3, 3, 1, 1], [3, 3, 2, 0],
]  # fmt: skip


def _pinned_tokenizer() -> SIDTokenizer:
    codebooks = (np.arange(48, dtype=np.float32).reshape(3, 4, 4) - 24) / 8  # exact floats
    return SIDTokenizer(PIN_CONFIG, codebooks)


def _pinned_embeddings() -> np.ndarray:
    return (np.random.default_rng(0).standard_normal((12, 4)) * 2).astype(np.float32)


def _creatives(groups: int = 64, dim: int = 8, noise: float = 1e-3, seed: int = 0):
    """float32 ads of `groups` creatives (2-6 ads each, shuffled): far-apart centres plus
    tiny noise; and each ad's creative."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((groups, dim)) * 10
    label = np.repeat(np.arange(groups), rng.integers(2, 7, groups))
    label = label[rng.permutation(len(label))]
    ads = centres[label] + noise * rng.standard_normal((len(label), dim))
    return ads.astype(np.float32), label


@pytest.fixture(scope="module")
def creatives() -> tuple[np.ndarray, np.ndarray]:
    return _creatives()


@pytest.fixture(scope="module")
def code_tokenizer(creatives) -> SIDTokenizer:
    return SIDTokenizer.train(creatives[0], CODE, progress=False)


# --------------------------------------------------------------------------- "rank" unchanged


def test_rank_mode_fingerprints_files_and_sids_are_unchanged(tmp_path: Path):
    tok = _pinned_tokenizer()
    assert tok.config.last_token == "rank"
    assert TokenizerConfig(last_token="rank") == TokenizerConfig()
    assert tok.fingerprint == PIN_FINGERPRINT
    zeros = np.zeros((3, 512, 2), np.float32)
    assert SIDTokenizer(TokenizerConfig(), zeros).fingerprint == PIN_DEFAULT_FINGERPRINT
    tok.save(tmp_path)
    assert (tmp_path / "tokenizer.json").read_text() == PIN_META
    sids, report = tok.assign(_pinned_embeddings())
    assert sids.tolist() == PIN_SIDS
    assert report == CollisionReport(
        prefixes=5, overflow_prefixes=1, ads_sharing_sid=6, max_group=7
    )
    assert report.sids is None and report.max_sid_group is None
    assert report.summary() == (
        "5 prefixes, largest holds 7 ads; 1 prefixes overflow, 6 ads share a SID"
    )


def test_old_tokenizer_json_without_the_field_loads_as_rank(tmp_path: Path):
    tok = _pinned_tokenizer()
    # the two files exactly as the code before `last_token` wrote them
    save_file(
        {"codebooks": tok.codebooks},
        str(tmp_path / "codebooks.safetensors"),
        metadata={"fingerprint": PIN_FINGERPRINT},
    )
    (tmp_path / "tokenizer.json").write_text(PIN_META)
    loaded = SIDTokenizer.load(tmp_path)
    assert loaded.config == PIN_CONFIG
    assert loaded.config.last_token == "rank"
    assert loaded.fingerprint == PIN_FINGERPRINT
    assert loaded.assign(_pinned_embeddings())[0].tolist() == PIN_SIDS


def test_last_token_config():
    assert TokenizerConfig().rq_levels == 3
    assert TokenizerConfig(last_token="code").rq_levels == 4
    assert "last_token" not in TokenizerConfig().to_dict()
    assert TokenizerConfig(last_token="code").to_dict()["last_token"] == "code"
    with pytest.raises(ValueError, match="last_token must be one of"):
        TokenizerConfig(last_token="tiger")  # type: ignore[arg-type]
    code = TokenizerConfig(levels=3, codebook_size=16, last_token="code")
    with pytest.raises(ValueError, match=r"float32 \[4, 16, dim\]"):
        SIDTokenizer(code, np.zeros((3, 16, 2), np.float32))  # rank's shape


# --------------------------------------------------------------------------- "code" mode


def test_near_duplicates_share_a_full_sid_and_creatives_stay_apart(code_tokenizer, creatives):
    ads, label = creatives
    sids, report = code_tokenizer.assign(ads)
    assert sids.dtype == np.int32 and sids.shape == (len(ads), CODE.levels + 1)
    assert code_tokenizer.codebooks.shape == (CODE.levels + 1, K, ads.shape[1])
    sid_of = {}
    for creative in range(label.max() + 1):
        members = np.unique(sids[label == creative], axis=0)
        assert len(members) == 1, f"creative {creative} split over {len(members)} SIDs"
        sid_of[creative] = tuple(members[0])
    assert len(set(sid_of.values())) == len(sid_of)  # distinct creatives, distinct SIDs
    sizes = np.bincount(label)
    assert report == reference_report(sids, K, code=True)
    assert report.sids == len(sid_of)
    assert report.max_sid_group == sizes.max()
    assert report.ads_sharing_sid == len(ads)  # every creative has >= 2 ads
    assert f"{len(sid_of)} distinct SIDs, largest holds {sizes.max()} ads" in report.summary()


def test_code_mode_extends_rank_mode(code_tokenizer, creatives):
    """Same config and data: "code" trains rank's codebooks plus one level, so the prefixes
    agree; "rank" instead gives every ad of a creative its own last token."""
    ads, _ = creatives
    rank = SIDTokenizer.train(ads, RANK, progress=False)
    np.testing.assert_array_equal(code_tokenizer.codebooks[: RANK.levels], rank.codebooks)
    code_sids, _ = code_tokenizer.assign(ads)
    rank_sids, rank_report = rank.assign(ads)
    np.testing.assert_array_equal(code_sids[:, : RANK.levels], rank_sids[:, : RANK.levels])
    np.testing.assert_array_equal(code_tokenizer.encode_prefix(ads), rank.encode_prefix(ads))
    assert rank_report.overflow_prefixes == 0 and rank_report.ads_sharing_sid == 0
    assert code_tokenizer.fingerprint != rank.fingerprint
    # the full SID reconstructs the ad up to the last level's residual
    error = ((ads - reconstruct(code_tokenizer, code_sids)) ** 2).sum(1).mean()
    assert error < ((ads - reconstruct(rank, rank_sids[:, : RANK.levels])) ** 2).sum(1).mean()


def test_the_mode_enters_the_fingerprint(monkeypatch):
    """Same codebooks, levels and size: only the recorded mode tells the two apart."""
    codebooks = np.random.default_rng(0).standard_normal((4, 8, 3)).astype(np.float32)
    code = SIDTokenizer(TokenizerConfig(levels=3, codebook_size=8, last_token="code"), codebooks)
    assert code.config.to_dict()["last_token"] == "code"
    with_mode = code.fingerprint

    # the same tokenizer with the mode left out of the hashed config: another fingerprint
    def without_mode(c: TokenizerConfig) -> dict:
        return {k: v for k, v in asdict(c).items() if k != "last_token"}

    monkeypatch.setattr(TokenizerConfig, "to_dict", without_mode)
    del code.__dict__["fingerprint"]  # a cached_property
    assert code.fingerprint != with_mode
    assert "last_token='code'" in repr(code)


def test_save_load_round_trip_keeps_the_mode(code_tokenizer, creatives, tmp_path: Path):
    ads, _ = creatives
    code_tokenizer.save(tmp_path)
    meta = orjson.loads((tmp_path / "tokenizer.json").read_bytes())
    assert meta["config"]["last_token"] == "code"
    loaded = SIDTokenizer.load(tmp_path)
    assert loaded.config == CODE
    assert loaded.fingerprint == code_tokenizer.fingerprint
    np.testing.assert_array_equal(loaded.assign(ads)[0], code_tokenizer.assign(ads)[0])
    # flipping the mode in the file is refused (the fingerprint no longer recomputes)
    text = (tmp_path / "tokenizer.json").read_text()
    (tmp_path / "tokenizer.json").write_text(text.replace('"code"', '"rank"'))
    with pytest.raises(ValueError, match="fingerprint mismatch"):
        SIDTokenizer.load(tmp_path)


def test_reserved_sids_change_nothing_but_the_report(code_tokenizer, creatives):
    ads, _ = creatives
    sids, _ = code_tokenizer.assign(ads)
    reserved = np.vstack([sids[:3], [[K - 1, K - 1, K - 1]], [[K - 1, K - 1, K - 1]]])
    with_reserved, report = code_tokenizer.assign(ads, reserved)
    np.testing.assert_array_equal(with_reserved, sids)
    assert report == reference_report(np.vstack([sids, reserved]), K, code=True)
    with pytest.raises(ValueError, match=r"int \[M, 3\]"):
        code_tokenizer.assign(ads[:2], np.zeros((1, 4), np.int32))


def test_empty_input(code_tokenizer):
    sids, report = code_tokenizer.assign(np.zeros((0, 8), np.float32))
    assert sids.shape == (0, CODE.levels + 1) and sids.dtype == np.int32
    assert report == CollisionReport(0, 0, 0, 0, sids=0, max_sid_group=0)


@settings(max_examples=40, deadline=None)
@given(
    ads=arrays(
        np.float32,
        st.tuples(st.integers(0, 60), st.just(8)),
        elements=st.floats(-40, 40, width=32),
    ),
    data=st.data(),
)
def test_a_code_sid_depends_on_its_own_embedding_only(code_tokenizer, ads, data):
    """Unlike "rank", where the last token depends on the other ads of the prefix: the SIDs
    are the RQ codes, in range, and the same for any order or subset of the input."""
    sids, report = code_tokenizer.assign(ads)
    assert sids.shape == (len(ads), CODE.levels + 1) and sids.dtype == np.int32
    assert ((sids >= 0) & (sids < K)).all()
    np.testing.assert_array_equal(sids, rq_encode(code_tokenizer.codebooks, ads)[0])
    order = data.draw(st.permutations(range(len(ads))))
    np.testing.assert_array_equal(code_tokenizer.assign(ads[order])[0], sids[order])
    np.testing.assert_array_equal(code_tokenizer.assign(ads, workers=3)[0], sids)
    if len(ads):
        assert report == reference_report(sids, K, code=True)
