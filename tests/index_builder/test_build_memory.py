"""Peak memory of a full `build_index` (issue #48): a Parquet catalog with embeddings ->
SIDs -> published index, measured as the build process's peak RSS per ad.

The build frees each large input once used (embeddings after the SIDs, the catalog in
input order once sorted, the arrays once written, the embedding column read once) — the
builder before that held ~940 bytes per ad here, now ~520. The build runs in a fresh
process (tests/helpers/peak_memory.py), with glibc and Arrow allocating large blocks
straight from the kernel, so freed memory leaves the RSS at once and the peak is what the
build holds, not the allocator's cache; on two threads, so the figure does not grow with
the machine's cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.peak_memory import CAN_RESET, peak_bytes_per_ad, write_catalog

ADS = 300_000
BOUND = 700  # bytes of peak RSS per ad, above what the process held before the build

_SETUP = """
import pyarrow as pa
pa.set_cpu_count(2)
from index_builder.build import build_index
import index_builder.tokenizer  # torch: loaded before the baseline
"""
_CALL = """build_index(arg + "/catalog.parquet", arg + "/out", tokenizer_path=arg + "/tok",
                  progress=False, workers=2)[1].counts["ads"]"""


@pytest.mark.skipif(not CAN_RESET, reason="Linux /proc figures")
def test_full_build_peak_memory_per_ad(tmp_path: Path) -> None:
    write_catalog(tmp_path, ADS)
    env = {
        "MALLOC_MMAP_THRESHOLD_": "65536",  # blocks past 64 KiB: mmap, unmapped when freed
        "ARROW_DEFAULT_MEMORY_POOL": "system",  # Arrow through the same malloc
    }
    per_ad = peak_bytes_per_ad(_SETUP, _CALL, tmp_path, ADS, env)
    assert per_ad < BOUND, f"build_index peaked at {per_ad:.0f} bytes per ad (bound {BOUND})"
