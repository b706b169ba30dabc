"""Model checkpoints: the one writer/reader pair for a trained retriever (docs/MODEL.md
"Checkpoints"). Training writes with `save_checkpoint`; the server, evaluation and `grace`
commands read with `load_checkpoint`. A checkpoint is a directory, written into a hidden
temporary sibling, fsynced and renamed into place:

    model.safetensors   the GenerativeRetriever state dict
    config.json         format and version, model_version, ModelConfig, the SID space
                        (`tokenizer_fingerprint`), weights sha256, created, `extra`
    tokenizer/          the SID tokenizer; absent for a model of a named SID space
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import orjson
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from contracts import sid_space as sid_spaces
from contracts import tokenizer_format
from contracts.index_format import file_sha256, fsync_path
from contracts.tensors import to_device
from contracts.versions import disk_full
from service.model.config import ModelConfig

FORMAT_NAME = "grace.model_checkpoint"
FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_DIR = "tokenizer"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: corrupt, incompatible or inconsistent."""


class Tokenizer(Protocol):
    """What a checkpoint stores of a SID tokenizer (`index_builder.tokenizer.SIDTokenizer`)."""

    @property
    def fingerprint(self) -> str: ...

    def save(self, path: Path) -> None: ...


@dataclass(frozen=True)
class LoadedModel:
    model: nn.Module  # GenerativeRetriever in eval mode, on the requested device
    config: ModelConfig
    model_version: str
    meta: dict[str, Any]  # config.json as stored
    seconds: dict[str, float] = field(default_factory=dict)  # per load phase: verify, read, ...

    @property
    def sid_space(self) -> str:
        """The key an index must carry to serve with this model (contracts/sid_space.py)."""
        return str(self.meta["tokenizer_fingerprint"])


def save_checkpoint(
    model: nn.Module,
    tokenizer: Tokenizer | None,
    path: Path,
    *,
    model_version: str | None = None,
    extra: dict[str, Any] | None = None,
    sid_space: str | None = None,
) -> str:
    """Write `model` (with a `.config: ModelConfig`) and `tokenizer` (else the name of its
    `sid_space`) to directory `path`, replacing any checkpoint there. Returns the model
    version: `model_version`, or `f"{config.name}-{sha256(weights)[:12]}"` by default."""
    if (tokenizer is None) == (sid_space is None):
        raise ValueError("a checkpoint needs its SID tokenizer or the name of its SID space")
    space = tokenizer.fingerprint if tokenizer is not None else sid_spaces.named(str(sid_space))
    path = Path(path)
    config: ModelConfig = model.config  # type: ignore[assignment]
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.mkdir()
        # clone: safetensors refuses aliased (tied) or non-contiguous tensors
        state = {
            k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()
        }
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": FORMAT_NAME})
        digest = file_sha256(tmp / WEIGHTS_FILE)
        version = model_version or f"{config.name}-{digest[:12]}"
        if tokenizer is not None:
            tokenizer.save(tmp / TOKENIZER_DIR)
        meta = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "model_version": version,
            "config": config.to_dict(),
            "tokenizer_fingerprint": space,
            "weights_sha256": digest,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "extra": extra or {},
        }
        option = orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY
        (tmp / CONFIG_FILE).write_bytes(orjson.dumps(meta, option=option))
        for p in tmp.rglob("*"):
            if p.is_file():
                fsync_path(p)
        fsync_path(tmp)
        _replace_dir(tmp, path)
    except BaseException as exc:
        full = disk_full(exc, path, "; nothing written")  # safetensors' error has no errno
        shutil.rmtree(tmp, ignore_errors=True)
        if full is None:
            raise
        raise full from exc
    return version


def load_checkpoint(
    path: Path,
    device: torch.device | str = "cpu",
    *,
    build: Callable[[ModelConfig], nn.Module] | None = None,
    pace: Callable[[], None] | None = None,
) -> LoadedModel:
    """Read and check a checkpoint; `build` makes the empty model (default GenerativeRetriever).
    `pace` is called between the load's steps (`service/pace.py`). Raises FileNotFoundError
    for a missing file, CheckpointError naming any other problem."""
    path = Path(path)
    seconds: dict[str, float] = {}
    t = time.perf_counter()

    def phase(name: str) -> None:  # the load's phases, for the log line of a swap
        nonlocal t
        now = time.perf_counter()
        seconds[name], t = now - t, now

    meta, config = _verified(path, pace)
    phase("verify")
    try:
        weights = load_file(str(path / WEIGHTS_FILE), device="cpu")
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise CheckpointError(f"checkpoint {path}: {WEIGHTS_FILE} unreadable ({e})") from e

    model = _empty(config, build)
    expected = model.state_dict()
    _check_weights(expected, weights, path)
    # safetensors maps the file: on a CPU the parameters would stay views of that mapping
    # (read lazily, and a file overwritten in place would change or crash the model), so
    # they get their own memory there; to a GPU they go in paced chunks (`to_device`)
    if torch.device(device).type == "cpu":
        weights = {k: v.to(expected[k].dtype, copy=True) for k, v in weights.items()}
    else:
        weights = {k: to_device(v.to(expected[k].dtype), device, pace)
                   for k, v in weights.items()}  # fmt: skip
    model.load_state_dict(weights, strict=True, assign=True)
    phase("weights")  # read and, off the CPU, copied to the device
    loaded = _fingerprint(model)
    for module in model.modules():
        if hasattr(module, "reset_buffers"):  # the buffers no checkpoint holds
            module.reset_buffers()
    after = _fingerprint(model)
    if after.keys() != loaded.keys():
        raise CheckpointError(f"checkpoint {path}: a reset_buffers added or removed state "
                              f"{sorted(after.keys() ^ loaded.keys())}")  # fmt: skip
    if changed := sorted(k for k in loaded if after[k] != loaded[k]):
        raise CheckpointError(f"checkpoint {path}: a reset_buffers changed loaded {changed}")
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:  # a module with state outside the checkpoint and no reset_buffers
        raise CheckpointError(f"checkpoint {path}: the model has state it does not hold: {left}")
    model.to(device).eval()
    phase("buffers")
    return LoadedModel(model, config, str(meta["model_version"]), meta, seconds)


def verify_checkpoint(
    path: Path, *, build: Callable[[ModelConfig], nn.Module] | None = None
) -> dict[str, Any]:
    """Every check `load_checkpoint` makes, without loading the weights (tensor names and
    shapes only). Returns config.json; raises as `load_checkpoint` does."""
    path = Path(path)
    meta, config = _verified(path)
    try:
        with safe_open(str(path / WEIGHTS_FILE), "pt") as fh:
            shapes = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}  # noqa: SIM118
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise CheckpointError(f"checkpoint {path}: {WEIGHTS_FILE} unreadable ({e})") from e
    stored = {k: torch.empty(shape, device="meta") for k, shape in shapes.items()}
    _check_weights(_empty(config, build).state_dict(), stored, path)
    return meta


def sid_space_of(path: Path) -> str | None:
    """The SID space a checkpoint's config.json names, or None when it cannot be read (a
    cheap look before a full load: `load_checkpoint` reports what is wrong)."""
    try:
        return str(orjson.loads((Path(path) / CONFIG_FILE).read_bytes())["tokenizer_fingerprint"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _verified(
    path: Path, pace: Callable[[], None] | None = None
) -> tuple[dict[str, Any], ModelConfig]:
    """config.json and the model config of a checkpoint whose files are all there, whose
    weights match their recorded sha256 and whose tokenizer (if any) its fingerprint."""
    for p in (path / CONFIG_FILE, path / WEIGHTS_FILE):
        if not p.exists():
            raise FileNotFoundError(f"checkpoint {path}: {p.name} is missing")
    meta = _read_meta(path / CONFIG_FILE)
    named_space = sid_spaces.is_named(str(meta["tokenizer_fingerprint"]))
    if not named_space and not (path / TOKENIZER_DIR).exists():
        raise FileNotFoundError(f"checkpoint {path}: {TOKENIZER_DIR} is missing")
    try:
        config = ModelConfig.from_dict(meta["config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: invalid model config ({e})") from e
    digest = file_sha256(path / WEIGHTS_FILE, between=pace)
    if digest != meta["weights_sha256"]:
        raise CheckpointError(
            f"checkpoint {path}: {WEIGHTS_FILE} is corrupt or truncated (sha256 {digest[:12]}, "
            f"config.json records {str(meta['weights_sha256'])[:12]})"
        )
    if not named_space:
        try:
            held = tokenizer_format.read(path / TOKENIZER_DIR)[2]
        except (FileNotFoundError, ValueError) as e:
            raise CheckpointError(f"checkpoint {path}: tokenizer unreadable: {e}") from e
        if held != meta["tokenizer_fingerprint"]:
            raise CheckpointError(
                f"checkpoint {path}: tokenizer mismatch: config.json names fingerprint "
                f"{meta['tokenizer_fingerprint']}, {TOKENIZER_DIR}/ holds {held}"
            )
    return meta, config


def _empty(config: ModelConfig, build: Callable[[ModelConfig], nn.Module] | None) -> nn.Module:
    """The model of `config` with shapes only (the meta device): no random init of
    weights about to be replaced."""
    if build is None:
        from service.model.retriever import GenerativeRetriever

        build = GenerativeRetriever
    with torch.device("meta"):
        return build(config)


def _fingerprint(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Per state_dict entry, its storage and in-place version (a write changes one)."""
    return {k: (v.data_ptr(), v._version) for k, v in model.state_dict().items()}


def _read_meta(p: Path) -> dict[str, Any]:
    try:
        meta = orjson.loads(p.read_bytes())
    except orjson.JSONDecodeError as e:
        raise CheckpointError(f"{p}: not valid JSON ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{p}: not a GRACE model checkpoint (format {FORMAT_NAME!r})")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{p}: unknown checkpoint format version {version!r}; "
            f"this build reads version {FORMAT_VERSION}"
        )
    required = ("config", "model_version", "tokenizer_fingerprint", "weights_sha256")
    if missing := [k for k in required if k not in meta]:
        raise CheckpointError(f"{p}: missing keys {missing}")
    return meta


def _check_weights(
    expected: dict[str, torch.Tensor], stored: dict[str, torch.Tensor], path: Path
) -> None:
    """Raise CheckpointError naming missing, unexpected or mis-shaped tensors."""
    problems = [
        f"{what} tensors {names[:5]}" + (" ..." if len(names) > 5 else "")
        for what, names in (
            ("missing", sorted(expected.keys() - stored.keys())),
            ("unexpected", sorted(stored.keys() - expected.keys())),
        )
        if names
    ]
    for name in sorted(expected.keys() & stored.keys()):
        want, got = list(expected[name].shape), list(stored[name].shape)
        if want != got:
            problems.append(f"shape mismatch for {name}: checkpoint {got}, config {want}")
    if problems:
        raise CheckpointError(
            f"checkpoint {path}: weights do not fit its config: " + "; ".join(problems)
        )


def _replace_dir(tmp: Path, path: Path) -> None:
    """Rename `tmp` to `path`. An old `path` is first renamed aside and removed after, so
    `path` is always absent or complete, never partially written."""
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_path(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
