"""The `grace` command line end to end: world -> tokenizer -> index -> validation, bad
input, and the builder sidecar rebuilding on catalog changes and stopping on SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cli import main
from contracts.index_manifest import read_manifest
from contracts.index_validation import validate_index
from index_builder.publish import current_path, current_version

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "world"
    assert main(["synth", "--profile", "tiny", "--seed", "3", "--out", str(out),
                 "--no-progress"]) == 0  # fmt: skip
    return out


@pytest.fixture(scope="module")
def tokenizer(world: Path) -> Path:
    out = world.parent / "tokenizer"
    catalog = str(world / "catalog.parquet")
    args = ["train-tokenizer", "--catalog", catalog, "--out", str(out), "--no-progress"]
    assert main(args) == 0
    return out


def test_world_to_validated_index(world: Path, tokenizer: Path, tmp_path: Path, capsys) -> None:
    root = tmp_path / "index"
    for catalog in ("catalog.parquet", "catalog.jsonl"):
        code = main(["build-index", "--catalog", str(world / catalog), "--tokenizer",
                     str(tokenizer), "--out", str(root), "--no-progress"])  # fmt: skip
        assert code == 0
    assert main(["validate-index", str(root)]) == 0
    out = capsys.readouterr().out
    assert "published" in out and "OK" in out
    index = validate_index(current_path(root))
    n_ads = json.loads((world / "world.json").read_text())["counts"]["ads"]
    assert index.arrays.ads.num_ads == n_ads
    assert index.manifest["tokenizer_fingerprint"] != "none"


def test_bad_catalog_names_line_and_field_and_publishes_nothing(tmp_path: Path, capsys) -> None:
    catalog = tmp_path / "bad.jsonl"
    rows = [
        {"ad_id": 1, "sid": [0, 0, 0, 0]},
        {"ad_id": 2, "sid": [0, 0, 0, 1]},
        {"ad_id": 3, "sid": [0, 0, 0, 2], "age_buckets": ["18-25"]},
    ]
    catalog.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    code = main(["build-index", "--catalog", str(catalog), "--out", str(tmp_path / "idx")])
    assert code == 2
    err = capsys.readouterr().err
    assert "line 3" in err and "age_buckets" in err
    assert current_version(tmp_path / "idx") is None


def test_missing_sids_without_tokenizer_say_what_to_do(world: Path, tmp_path: Path, capsys):
    code = main(["build-index", "--catalog", str(world / "catalog.parquet"), "--out",
                 str(tmp_path / "idx"), "--no-progress"])  # fmt: skip
    assert code == 2
    assert "tokenizer" in capsys.readouterr().err


def test_validate_index_exits_non_zero_on_corruption(world, tokenizer, tmp_path, capsys):
    root = tmp_path / "index"
    main(["build-index", "--catalog", str(world / "catalog.parquet"), "--tokenizer",
          str(tokenizer), "--out", str(root), "--no-progress"])  # fmt: skip
    victim = current_path(root) / "trie.csr_tokens.npy"
    victim.write_bytes(victim.read_bytes()[:-7])
    assert main(["validate-index", str(root)]) == 1
    assert "trie.csr_tokens.npy" in capsys.readouterr().err


def _write_catalog(path: Path, n: int, bad: bool = False) -> None:
    rows = [{"ad_id": 10 + i, "sid": [i % 3, i % 5, i, 0], "countries": ["US"]} for i in range(n)]
    if bad:
        rows[1]["genders"] = ["robot"]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tmp.replace(path)


def _wait(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_builder_sidecar_rebuilds_on_change_skips_bad_catalogs_and_stops_on_sigterm(
    tmp_path: Path,
) -> None:
    catalog, root = tmp_path / "catalog.jsonl", tmp_path / "index"
    _write_catalog(catalog, 20)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "builder", "--catalog", str(catalog),
         "--out", str(root), "--interval", "0.2"],
        cwd=REPO, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: list[str] = []  # its log, read as it runs: what it did is waited for

    def read_log() -> None:
        for line in proc.stderr:
            lines.append(line)

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    try:
        _wait(lambda: current_version(root) is not None)
        first = current_version(root)
        assert read_manifest(current_path(root))["counts"]["ads"] == 20
        time.sleep(0.5)
        assert current_version(root) == first  # unchanged catalog: no rebuild
        _write_catalog(catalog, 30)
        _wait(lambda: current_version(root) != first)
        second = current_version(root)
        assert read_manifest(current_path(root))["counts"]["ads"] == 30
        _write_catalog(catalog, 40, bad=True)
        _wait(lambda: any("build failed" in line for line in lines))
        assert current_version(root) == second  # the bad catalog published nothing
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(60)
    log = "".join(lines)
    assert "build failed" in log and "line 2" in log and "genders" in log
    assert "received SIGTERM" in log and "builder stopped: 2 builds, 1 failures" in log


def test_init_model_writes_a_loadable_untrained_checkpoint(tokenizer: Path, tmp_path: Path):
    from index_builder.tokenizer import SIDTokenizer
    from service.model.checkpoint import load_checkpoint

    assert main(["init-model", "--profile", "tiny", "--tokenizer", str(tokenizer),
                 "--out", str(tmp_path / "m")]) == 0  # fmt: skip
    loaded = load_checkpoint(tmp_path / "m", "cpu")
    assert loaded.config.name == "tiny" and "untrained" in loaded.model_version
    assert loaded.sid_space == SIDTokenizer.load(tokenizer).fingerprint
