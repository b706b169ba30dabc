"""A full disk under the model's writers (a real tmpfs): `grace publish-model` (the real
command) fails with one line naming the repository and "no space left on device" and
leaves only the valid versions, CURRENT where it was; `save_checkpoint` (what `grace
train` writes with: safetensors' error carries no errno) names the checkpoint and leaves
an existing one there as it was."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from contracts.versions import DiskFullError, current_version
from service.model.checkpoint import save_checkpoint, verify_checkpoint
from service.model.config import PROFILES
from service.model.repository import list_versions
from service.model.retriever import GenerativeRetriever
from tests.helpers.tmpfs import PAGE, fill, free_bytes, small_tmpfs

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


def tiny_checkpoint(out: Path, seed: int = 0) -> str:
    torch.manual_seed(seed)
    return save_checkpoint(GenerativeRetriever(PROFILES["tiny"]), None, out, sid_space="disk")


def publish_model_cli(checkpoint: Path, root: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "cli", "publish-model", str(checkpoint), "--root", str(root)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)


def test_publish_model_into_a_full_repository_says_so_and_leaves_nothing(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    tiny_checkpoint(checkpoint)
    with small_tmpfs(tmp_path / "fs", 32 << 20) as fs:
        root = fs / "models"
        before = free_bytes(fs)
        done = publish_model_cli(checkpoint, root)
        assert done.returncode == 0, done.stderr
        [first] = list_versions(root)
        version_bytes = before - free_bytes(fs) - PAGE  # the copy and its marker (CURRENT)
        baseline = free_bytes(fs)
        # the last level: the copy and its marker fit, CURRENT's temp file does not
        for leave in (0, PAGE, version_bytes // 2, version_bytes - PAGE, version_bytes):
            filler = fill(fs, leave)
            done = publish_model_cli(checkpoint, root)
            assert done.returncode != 0, f"published with {leave} bytes free"
            [line] = [x for x in done.stderr.splitlines() if x.startswith("grace publish-model")]
            assert f"{root}: no space left on device" in line, line
            assert f"CURRENT still names {first}" in line and "Traceback" not in done.stderr
            filler.unlink()
            assert sorted(p.name for p in root.iterdir()) == sorted([first, "CURRENT", ".lock"])
            assert current_version(root) == first
            assert free_bytes(fs) == baseline, f"{leave} bytes free: files left behind"
        verify_checkpoint(root / first)


def test_save_checkpoint_on_a_full_disk_names_it_and_keeps_the_old_one(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "fs", 24 << 20) as fs:
        path = fs / "model"
        old = tiny_checkpoint(path, seed=0)
        baseline = free_bytes(fs)
        for leave in (0, PAGE, 4 << 20):  # safetensors' own error at the last two
            filler = fill(fs, leave)
            with pytest.raises(DiskFullError) as caught:
                tiny_checkpoint(path, seed=1)
            assert str(caught.value).startswith(f"{path}: no space left on device"), caught.value
            filler.unlink()
            assert sorted(p.name for p in fs.iterdir()) == ["model"]  # no temp directory
            assert verify_checkpoint(path)["model_version"] == old
            assert free_bytes(fs) == baseline
