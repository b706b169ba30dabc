"""Model checkpoints: round trip, and every way a checkpoint can be refused."""

from __future__ import annotations

import functools
import hashlib
import shutil
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
from safetensors.torch import load_file, save_file

from index_builder.tokenizer import SIDTokenizer, TokenizerConfig
from service.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from service.model.config import PROFILES
from service.model.features import FeatureBatch
from service.model.retriever import GenerativeRetriever

CONFIG = PROFILES["tiny"]


def _tokenizer(seed: int = 0) -> SIDTokenizer:
    cfg = TokenizerConfig(levels=3, codebook_size=16, seed=seed)
    codebooks = np.random.default_rng(seed).normal(size=(3, 16, 8)).astype(np.float32)
    return SIDTokenizer(cfg, codebooks)


def _features(b: int = 3, width: int = 5) -> FeatureBatch:
    g = torch.Generator().manual_seed(0)
    mask = torch.arange(width)[None] < torch.tensor([width, 2, 0])[:b, None]
    return FeatureBatch(
        user_hash=torch.randint(0, CONFIG.user_hash_buckets, (b,), generator=g),
        country=torch.randint(0, 250, (b,), generator=g),
        age_bucket=torch.randint(0, 8, (b,), generator=g),
        gender=torch.randint(0, 3, (b,), generator=g),
        hist_sid=torch.randint(0, 512, (b, width, 4), generator=g) * mask[..., None],
        hist_type=torch.ones(b, width, dtype=torch.int64) * mask,
        hist_gap=torch.randint(0, 16, (b, width), generator=g) * mask,
        hist_mask=mask,
    )


@pytest.fixture(scope="module")
def model() -> GenerativeRetriever:
    torch.manual_seed(0)
    return GenerativeRetriever(CONFIG).eval()


@pytest.fixture()
def saved(model, tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    save_checkpoint(model, _tokenizer(), path, extra={"recall@100": 0.25})
    return path


def _edit_meta(path: Path, **changes) -> None:
    meta = orjson.loads((path / "config.json").read_bytes())
    for k, v in changes.items():
        if k == "config":
            meta["config"].update(v)
        else:
            meta[k] = v
    (path / "config.json").write_bytes(orjson.dumps(meta))


def _rewrite_weights(path: Path, weights: dict[str, torch.Tensor]) -> None:
    """Replace the weights and record their new sha256, as a consistent writer would."""
    save_file(weights, str(path / "model.safetensors"))
    digest = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    _edit_meta(path, weights_sha256=digest)


def test_round_trip_gives_identical_outputs(model, saved):
    loaded = load_checkpoint(saved)
    f, sid = _features(), torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [0, 511, 0, 511]])
    with torch.no_grad():
        assert torch.equal(loaded.model.forward_train(f, sid), model.forward_train(f, sid))
        assert torch.equal(loaded.model.encode(f), model.encode(f))
    assert not loaded.model.training
    assert loaded.config == CONFIG
    assert loaded.sid_space == _tokenizer().fingerprint
    assert loaded.meta["extra"] == {"recall@100": 0.25}
    weights_sha = hashlib.sha256((saved / "model.safetensors").read_bytes()).hexdigest()
    assert loaded.model_version == f"tiny-{weights_sha[:12]}"


def test_explicit_model_version_and_overwrite(model, saved):
    version = save_checkpoint(model, _tokenizer(), saved, model_version="tiny-v7")
    assert version == "tiny-v7"
    assert load_checkpoint(saved).model_version == "tiny-v7"
    assert sorted(p.name for p in saved.parent.iterdir()) == ["ckpt"]  # no temp dirs left


def test_failed_save_leaves_nothing_behind(model, tmp_path: Path):
    with pytest.raises(TypeError):
        save_checkpoint(model, _tokenizer(), tmp_path / "ckpt", extra={"bad": object()})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer"])
def test_missing_file_is_named(saved, name):
    target = saved / name
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    with pytest.raises(FileNotFoundError, match=name):
        load_checkpoint(saved)


def test_unknown_format_version_is_refused(saved):
    _edit_meta(saved, format_version=99)
    with pytest.raises(CheckpointError, match="unknown checkpoint format version 99"):
        load_checkpoint(saved)


def test_not_a_checkpoint_is_refused(saved):
    (saved / "config.json").write_text('{"hello": 1}')
    with pytest.raises(CheckpointError, match="not a GRACE model checkpoint"):
        load_checkpoint(saved)


def test_tokenizer_mismatch_is_refused(saved):
    shutil.rmtree(saved / "tokenizer")
    _tokenizer(seed=1).save(saved / "tokenizer")
    with pytest.raises(CheckpointError, match="tokenizer mismatch"):
        load_checkpoint(saved)


def test_shape_mismatch_names_the_tensor(saved):
    _edit_meta(saved, config={"encoder_d_ff": 64})
    with pytest.raises(CheckpointError, match=r"shape mismatch for encoder\.layers\.0\.ffn\.up"):
        load_checkpoint(saved)


def test_missing_tensor_is_named(saved):
    weights = load_file(str(saved / "model.safetensors"))
    del weights["decoder.head.weight"]
    _rewrite_weights(saved, weights)
    with pytest.raises(CheckpointError, match=r"missing tensors \['decoder\.head\.weight'\]"):
        load_checkpoint(saved)


def test_truncated_weights_are_refused(saved):
    raw = (saved / "model.safetensors").read_bytes()
    (saved / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint(saved)
    # even with a checksum that matches the truncated file, the reader refuses it
    digest = hashlib.sha256(raw[: len(raw) // 2]).hexdigest()
    _edit_meta(saved, weights_sha256=digest)
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(saved)


def test_weights_stored_in_another_dtype_load_as_the_model_is_built(model, saved):
    """The model is built on the meta device and takes the stored tensors: a bf16 file
    still gives the fp32 parameters the model declares (as a copying load would)."""
    stored = load_file(str(saved / "model.safetensors"))
    weights = {k: v.to(torch.bfloat16) for k, v in stored.items()}
    _rewrite_weights(saved, weights)
    loaded = load_checkpoint(saved)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.float32}
    assert torch.equal(loaded.model.decoder.head.weight, weights["decoder.head.weight"].float())
    assert loaded.model.embedder.sid_offsets.tolist() == [
        p * CONFIG.vocab_size for p in range(CONFIG.sid_length)
    ]  # the buffer no checkpoint holds is made again


def test_state_outside_the_checkpoint_without_reset_buffers_is_refused(saved):
    """A model whose non-persistent buffer would stay on the meta device: a clear error."""

    class WithBuffer(GenerativeRetriever):
        def __init__(self, config) -> None:
            super().__init__(config)
            self.register_buffer("scale", torch.ones(3), persistent=False)

    with pytest.raises(CheckpointError, match=r"does not hold: \['scale'\]"):
        load_checkpoint(saved, build=WithBuffer)


def test_a_checkpoint_overwritten_after_loading_leaves_the_model_unchanged(model, saved):
    """The loaded model owns its weights: the file rewritten in place afterwards (as `cp`
    over it would) changes nothing the model computes (no view of a file mapping)."""
    loaded = load_checkpoint(saved)
    f = _features()
    with torch.no_grad():
        before = loaded.model.encode(f).clone()
        weights = saved / "model.safetensors"
        size = weights.stat().st_size
        state = {k: v.clone() for k, v in loaded.model.state_dict().items()}
        with weights.open("r+b") as fh:  # same size, new bytes, same inode
            fh.write(b"\x7f" * size)
        assert torch.equal(loaded.model.encode(f), before)
        for k, v in loaded.model.state_dict().items():
            assert torch.equal(v, state[k]), k


class _Replaces(GenerativeRetriever):
    def reset_buffers(self) -> None:
        head = self.decoder.head
        head.weight = torch.nn.Parameter(torch.zeros_like(head.weight))


class _Overwrites(GenerativeRetriever):
    def reset_buffers(self) -> None:
        with torch.no_grad():
            self.decoder.head.weight.zero_()


class _Adds(GenerativeRetriever):
    def reset_buffers(self) -> None:
        self.register_buffer("extra", torch.ones(2))


@pytest.mark.parametrize(
    ("build", "said"),
    [(_Replaces, r"changed loaded \['decoder\.head\.weight'\]"),
     (_Overwrites, r"changed loaded \['decoder\.head\.weight'\]"),
     (_Adds, r"added or removed state \['extra'\]")],
)  # fmt: skip
def test_a_reset_buffers_that_touches_loaded_state_is_refused(saved, build, said):
    """`reset_buffers` may only make what the checkpoint does not hold."""
    with pytest.raises(CheckpointError, match=said):
        load_checkpoint(saved, build=build)


def test_a_model_of_a_named_sid_space_has_no_tokenizer(model, tmp_path: Path) -> None:
    """SIDs made outside (contracts/sid_space.py): the checkpoint stores the SID space's
    name instead of a tokenizer, loads without one, and must name one or the other."""
    path = tmp_path / "named"
    save_checkpoint(model, None, path, sid_space="tiger-v3")
    assert not (path / "tokenizer").exists()
    loaded = load_checkpoint(path)
    assert loaded.sid_space == "sid-space:tiger-v3"
    for tokenizer, space in ((None, None), (_tokenizer(), "tiger-v3")):
        with pytest.raises(ValueError, match="its SID tokenizer or the name of its SID space"):
            save_checkpoint(model, tokenizer, tmp_path / "x", sid_space=space)
    with pytest.raises(ValueError, match="SID space name 'no spaces'"):
        save_checkpoint(model, None, tmp_path / "y", sid_space="no spaces")


def test_a_paced_load_checks_and_paces_every_chunk_of_the_checksum(model, saved, monkeypatch):
    import contracts.index_format as fmt

    monkeypatch.setattr(fmt, "SHA_CHUNK", 4096)  # many chunks of the tiny model's weights
    calls: list[int] = []
    loaded = load_checkpoint(saved, pace=lambda: calls.append(1))
    size = (saved / "model.safetensors").stat().st_size
    assert len(calls) == -(-size // 4096)  # one call per chunk hashed
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[k], v), k
    (saved / "model.safetensors").write_bytes(b"\0" * size)  # same size, other bytes
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint(saved, pace=lambda: None)  # the chunked hash still catches it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_tensors_reach_the_gpu_whole_in_chunks(dtype, monkeypatch):
    import contracts.tensors as tensors

    monkeypatch.setattr(tensors, "COPY_CHUNK", 1 << 12)  # a chunk of 4 KiB: many per tensor
    for shape in [(0,), (7,), (333, 17), (3, 4096, 2)]:
        paced: list[int] = []
        t = (torch.randn(shape) * 100).to(dtype)
        out = tensors.to_device(t, "cuda", functools.partial(paced.append, 1))
        assert out.device.type == "cuda" and out.shape == t.shape and out.dtype == dtype
        assert torch.equal(out.cpu(), t)
        assert len(paced) == -(-t.numel() * t.element_size() // tensors.COPY_CHUNK)  # per chunk
