"""Peak memory of a full `build_index` (issue #48): a Parquet catalog with embeddings ->
SIDs -> published index, measured as the build process's peak RSS per ad.

The build frees each large input once used (embeddings after the SIDs, the catalog in
input order column by column once sorted, the arrays once written), never holds every
trie entry's matcher rows (deduplicated depth by depth) and makes glibc and Arrow return
what it frees at once (`build._returning_freed_memory`), so the peak is what it holds, not
the allocators' caches. The build runs in a fresh process (tests/helpers/peak_memory.py)
as production runs it: no allocator environment variables, on two threads, so the figure
does not grow with the machine's cores. Here (300,000 ads, where a few decoded row groups
still weigh ~100 bytes per ad) it peaks at ~380 bytes per ad; the builder before held
~1,150 here (~520 with the allocators set from the environment); a paper-world build at
10 M ads peaks at ~220.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.peak_memory import CAN_RESET, peak_bytes_per_ad, write_catalog

ADS = 300_000
BOUND = 450  # bytes of peak RSS per ad, above what the process held before the build

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
    per_ad = peak_bytes_per_ad(_SETUP, _CALL, tmp_path, ADS)
    assert per_ad < BOUND, f"build_index peaked at {per_ad:.0f} bytes per ad (bound {BOUND})"
