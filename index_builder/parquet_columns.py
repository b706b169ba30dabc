"""One Parquet catalog file's columns, read row group by row group (`catalog_files.
read_parquet` calls `read_columns` once its column types are checked; the columns go on to
`catalog_parts.py` and the checks of `catalog_columns.py`).

Row groups are decoded on a few threads at once (one group per thread: Arrow alone
decodes a group's columns in parallel, so its widest column, the embeddings, on one
core), and consumed in order; pages are read through a small buffer (`_fragments`), so
that the reader's own memory stays a few decoded groups. The embedding column, most of a
catalog's bytes, is copied group by group into one float32 buffer while its rows are all
of one width with no nulls (the common case), so it never exists twice; the other
columns, or an embedding column that is not that simple, are concatenated once every
group is read, one column at a time. The arrays are the ones
`pa.concat_tables(...).column(f).combine_chunks()` gives.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as fs
import pyarrow.parquet as pq
from tqdm import tqdm

_I32_MAX = 2**31 - 1
# Row groups decoded at once (one per Arrow thread, up to this many): each decoded group
# is held until consumed (~50 MB for 262,144 paper-world rows), however many cores there are
MAX_DECODING = 4
# Pages are read through a buffer of this many bytes, not a column chunk (or, pre-buffered,
# a row group) at a time
READ_BUFFER = 1 << 20


class _Packed:
    """A list<float32> column's rows of one width, packed into one float32 buffer as its
    chunks arrive; `add` refuses a chunk that does not fit (nulls, another width)."""

    def __init__(self, n: int, type_: pa.DataType) -> None:
        self.n, self.type, self.rows, self.dim = n, type_, 0, 0
        self.values: np.ndarray | None = None

    def add(self, chunk: pa.Array) -> bool:
        if chunk.type != self.type or chunk.null_count or self.rows + len(chunk) > self.n:
            return False
        if not len(chunk):
            return True
        flat = chunk.flatten()
        if flat.null_count:
            return False
        lengths = pc.list_value_length(chunk).to_numpy()
        if self.values is None:
            self.dim = int(lengths[0])
            if self.dim == 0:
                return False
            self.values = np.empty(self.n * self.dim, dtype=np.float32)
        if np.any(lengths != self.dim):
            return False
        at = self.rows * self.dim
        self.values[at : at + len(flat)] = flat.to_numpy()
        self.rows += len(chunk)
        return True

    def array(self) -> pa.Array:
        """The rows packed so far as one list array (no copy): of the column's type, or a
        large list where they hold more values than 32-bit offsets reach (at dim 32, past
        67 M rows)."""
        if self.values is None:
            return pa.array([], type=self.type)
        items = pa.array(self.values[: self.rows * self.dim])
        if self.rows * self.dim <= _I32_MAX:
            offsets = np.arange(0, (self.rows + 1) * self.dim, self.dim, dtype=np.int32)
            return pa.ListArray.from_arrays(pa.array(offsets), items, type=self.type)
        offsets = np.arange(0, (self.rows + 1) * self.dim, self.dim, dtype=np.int64)
        return pa.LargeListArray.from_arrays(pa.array(offsets), items)


def _fragments(path: Path) -> list[ds.ParquetFileFragment]:
    """The file's row groups as dataset fragments, in order: read through them, pages come
    through READ_BUFFER and every buffer from the default memory pool (`pq.ParquetFile`
    reads pages into Arrow's built-in pool, mimalloc or jemalloc, which keeps what it
    frees and which `pa.set_memory_pool` does not replace)."""
    scan = ds.ParquetFragmentScanOptions(
        pre_buffer=False, use_buffered_stream=True, buffer_size=READ_BUFFER
    )
    file_format = ds.ParquetFileFormat(default_fragment_scan_options=scan)
    whole = file_format.make_fragment(str(path.absolute()), filesystem=fs.LocalFileSystem())
    return whole.split_by_row_group()


def _groups(
    path: Path, pf: pq.ParquetFile, fields: list[str], workers: int
) -> Iterator[tuple[int, pa.Table]]:
    """(row group, its table) in order, up to `workers` groups decoded at once, each on a
    thread of its own (one: Arrow's threads decode a group's columns)."""
    fragments = _fragments(path)
    assert len(fragments) == pf.num_row_groups, (len(fragments), pf.num_row_groups)

    def read(group: int, threads: bool = False) -> pa.Table:
        rows = max(1, pf.metadata.row_group(group).num_rows)  # one batch: the group's
        return fragments[group].to_table(columns=fields, use_threads=threads, batch_size=rows)

    if workers <= 1 or pf.num_row_groups <= 1:
        for group in range(pf.num_row_groups):
            yield group, read(group, threads=True)
        return
    with ThreadPoolExecutor(workers) as pool:
        pending: deque[tuple[int, Future[pa.Table]]] = deque()
        for group in range(pf.num_row_groups):
            pending.append((group, pool.submit(read, group)))
            if len(pending) > workers:
                done, future = pending.popleft()
                yield done, future.result()
        while pending:
            done, future = pending.popleft()
            yield done, future.result()


def read_columns(
    path: Path, pf: pq.ParquetFile, fields: list[str], progress: bool
) -> dict[str, pa.Array]:
    """Each of `fields` over every row group of `pf` (opened at `path`) as one array."""
    schema = pf.schema_arrow
    chunks: dict[str, list[pa.Array]] = {f: [] for f in fields}
    packed = None
    if "embedding" in fields:
        kind = schema.field("embedding").type
        if pa.types.is_list(kind) and kind.value_type == pa.float32():
            packed = _Packed(pf.metadata.num_rows, kind)
    workers = max(1, min(pa.cpu_count(), MAX_DECODING))
    with tqdm(total=pf.metadata.num_rows, unit="row", disable=not progress) as bar:
        bar.set_description(f"catalog {path.name}")
        for group, table in _groups(path, pf, fields, workers):
            for f in fields:
                for chunk in table.column(f).chunks:
                    if f == "embedding" and packed is not None:
                        if packed.add(chunk):
                            continue
                        chunks[f].append(packed.array())  # the rows before, then as read
                        packed = None
                    chunks[f].append(chunk)
            del table
            bar.update(pf.metadata.row_group(group).num_rows)
    out = {}
    for f in fields:  # one column at a time: its chunks are freed as it is combined
        if f == "embedding" and packed is not None:
            out[f] = packed.array()
            continue
        parts, kind = chunks.pop(f), schema.field(f).type
        if pa.types.is_list(kind) and (
            any(p.type != kind for p in parts)
            or sum(pc.sum(pc.list_value_length(p)).as_py() or 0 for p in parts) > _I32_MAX
        ):
            kind = pa.large_list(kind.value_type)  # more values than 32-bit offsets reach
            parts = [p.cast(kind) for p in parts]
        column = pa.chunked_array(parts, type=kind)
        del parts
        out[f] = column.combine_chunks()
    return out
