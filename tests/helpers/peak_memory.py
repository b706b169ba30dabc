"""Peak memory per ad of one call in a fresh process, and the Parquet catalog the
build-memory tests measure it on (tests/index_builder/test_build_memory.py,
test_validation_memory.py).

The call runs in a child process whose high-water mark is reset just before it
(/proc/self/clear_refs "5", then VmHWM): its own figures, not the pytest parent's (which
ru_maxrss would count). A kernel or sandbox that refuses the reset skips the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from contracts.tokenizer_format import TokenizerConfig
from index_builder.tokenizer import SIDTokenizer

REPO = Path(__file__).resolve().parents[2]
CAN_RESET = Path("/proc/self/clear_refs").exists()

_SCRIPT = """
import json, re, sys
from pathlib import Path
{setup}

def kib(key):
    return int(re.search(key + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text())[1])

arg = sys.argv[1]
try:
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts here
except OSError as exc:
    print(json.dumps({{"skip": str(exc)}}))
    sys.exit(0)
before = kib("VmRSS")
ads = {call}
print(json.dumps({{"ads": ads, "grew": (kib("VmHWM") - before) * 1024}}))
"""


def peak_bytes_per_ad(
    setup: str, call: str, arg: Path, ads: int, env: Mapping[str, str] | None = None
) -> float:
    """The peak RSS per ad that `call` (an expression of `arg`, a str, giving the number of
    ads it handled; `setup` imports what it needs before the baseline) adds in a fresh
    process; the test is skipped where the peak cannot be reset."""
    script = _SCRIPT.format(setup=setup, call=call)
    run = subprocess.run(
        [sys.executable, "-c", script, str(arg)],
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, cwd=REPO,
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in got:
        pytest.skip(f"cannot reset the peak RSS here: {got['skip']}")
    assert got["ads"] == ads
    return got["grew"] / ads


def write_catalog(root: Path, ads: int, dim: int = 32) -> None:
    """root/catalog.parquet: `ads` ads with embeddings, countries and locations (row groups
    of 65,536), and root/tok: a tokenizer of random codebooks (no training)."""
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(ads * dim,)).astype(np.float32)
    starts = np.arange(0, (ads + 1) * dim, dim, dtype=np.int32)
    k = rng.integers(0, 3, ads)
    places = np.array([f"US/R{i}" for i in range(2000)], dtype=object)
    countries = np.array(["US", "CA", "GB", "DE"], dtype=object)[rng.integers(0, 4, ads)]
    table = pa.table(
        {
            "ad_id": pa.array(np.arange(1, ads + 1) * 7, pa.int64()),
            "embedding": pa.ListArray.from_arrays(pa.array(starts), pa.array(emb)),
            "countries": pa.array([[c] for c in countries]),
            "locations": pa.ListArray.from_arrays(
                pa.array(np.r_[0, np.cumsum(k)].astype(np.int32)),
                pa.array(places[rng.integers(0, len(places), int(k.sum()))].tolist()),
            ),
        }
    )
    pq.write_table(table, root / "catalog.parquet", row_group_size=65_536)
    codebooks = rng.normal(size=(3, 512, dim)).astype(np.float32)
    SIDTokenizer(TokenizerConfig(), codebooks).save(root / "tok")
