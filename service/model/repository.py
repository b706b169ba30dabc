"""The model repository: checkpoints published as versions under one root with a `CURRENT`
pointer, by the versioned-root protocol indexes use (`contracts/versions.py`; docs/MODEL.md
"Model repository"). A plain checkpoint directory serves as a fixed version.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from contracts import versions
from contracts.index_format import fsync_path
from service.model import gate
from service.model.checkpoint import (
    CONFIG_FILE,
    TOKENIZER_DIR,
    WEIGHTS_FILE,
    CheckpointError,
    verify_checkpoint,
)

log = logging.getLogger("grace.model")
COMPLETE = CONFIG_FILE  # written last into a version: its presence means complete
GATE_FILE = "gate.json"  # what the model gate measured at publish (docs/MODEL.md)


def is_checkpoint(path: Path) -> bool:
    """Whether `path` is one checkpoint directory (not a repository root)."""
    return (Path(path) / CONFIG_FILE).is_file()


def resolve_checkpoint(path: Path) -> Path:
    """The checkpoint at `path`: the directory itself, or a repository's CURRENT version.
    FileNotFoundError with a one-line reason when there is none."""
    path = Path(path)
    if is_checkpoint(path):
        return path
    version = versions.current_version(path)
    if version is None:
        raise FileNotFoundError(
            f"{path}: neither a model checkpoint ({CONFIG_FILE}) nor a model repository with "
            f"a {versions.CURRENT} (grace train --out, grace publish-model)"
        )
    if not is_checkpoint(path / version):
        raise FileNotFoundError(f"{path}: {versions.CURRENT} names {version}, which is missing")
    return path / version


def fp8_record(checkpoint: Path) -> dict[str, Any] | None:
    """The FP8 quality record the gate kept in `checkpoint`'s gate.json at publish
    (`precision.fp8_verdict`), or None: none made, or a checkpoint not published."""
    path = Path(checkpoint) / GATE_FILE
    try:
        record = json.loads(path.read_text()).get("fp8")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("%s cannot be read (%s): taken as no FP8 quality record", path, exc)
        return None
    return record if isinstance(record, dict) else None


def list_versions(root: Path) -> list[str]:
    """Complete model versions under root, oldest first."""
    return versions.list_versions(root, COMPLETE)


def version_is_valid(root: Path, version: str) -> bool | None:
    """True if `version` is marked valid or verifies now (then it is marked); False if it
    fails verification; None if it cannot be read at all (unknown: keep it)."""
    directory = Path(root) / version
    if versions.is_marked_valid(directory, COMPLETE):
        return True
    try:
        verify_checkpoint(directory)
    except CheckpointError as exc:
        log.warning("model %s is invalid: %s", version, exc)
        return False
    except OSError as exc:
        log.warning("model %s cannot be checked, kept: %s", version, exc)
        return None
    versions.mark_valid(directory, COMPLETE)
    return True


def publish_model(
    checkpoint: Path,
    root: Path,
    *,
    keep: int = 3,
    canary: Callable[[], Any] | None = None,
    fp8: Callable[[], dict[str, Any]] | None = None,
) -> str:
    """Publish the checkpoint at `checkpoint` as a new version of the repository `root`
    and point CURRENT at it; keep the newest `keep` valid versions. Raises CheckpointError
    or FileNotFoundError (nothing published) for a checkpoint that does not verify or that
    the model gate refuses (`gate.py`: the weights, then `canary`, which returns figures).
    `fp8` makes the version's FP8 quality record (`precision.fp8_verdict`), which never
    refuses: a record that fails only keeps `dtype = auto` at bfloat16."""
    source = Path(checkpoint)
    verify_checkpoint(source)  # refuse before copying gigabytes
    gate.check_finite(load_file(source / WEIGHTS_FILE), f"checkpoint {source}")
    checked = {
        "finite": True,
        "canary": canary() if canary is not None else None,
        "fp8": fp8() if fp8 is not None else None,
    }

    def write(directory: Path, version: str) -> None:
        shutil.copyfile(source / WEIGHTS_FILE, directory / WEIGHTS_FILE)
        (directory / GATE_FILE).write_text(json.dumps(checked, indent=1) + "\n")
        if (source / TOKENIZER_DIR).is_dir():
            shutil.copytree(source / TOKENIZER_DIR, directory / TOKENIZER_DIR)
        for p in directory.rglob("*"):
            if p.is_file():
                fsync_path(p)
        shutil.copyfile(source / CONFIG_FILE, directory / CONFIG_FILE)  # last: complete
        fsync_path(directory / CONFIG_FILE)

    def check(directory: Path, version: str) -> None:
        verify_checkpoint(directory)  # the copy, as the server will read it

    return versions.publish_version(
        root, write, complete=COMPLETE, keep=keep, check=check, is_valid=version_is_valid,
        what="model publisher",
    )  # fmt: skip
