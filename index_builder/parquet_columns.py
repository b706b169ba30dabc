"""One Parquet catalog file's columns, read row group by row group (`catalog_files.
read_parquet` calls `read_columns` once its column types are checked; the columns go on to
`catalog_parts.py` and the checks of `catalog_columns.py`).

Row groups are decoded on a few threads at once (one group per thread: Arrow alone
decodes a group's columns in parallel, so its widest column, the embeddings, on one
core), and consumed in order. The embedding column, most of a catalog's bytes, is copied
group by group into one float32 buffer while its rows are all of one width with no
nulls (the common case), so it never exists twice; the other columns, or an embedding
column that is not that simple, are concatenated once every group is read, one column at
a time. The arrays are the ones `pa.concat_tables(...).column(f).combine_chunks()` gives.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

_I32_MAX = 2**31 - 1


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
            if self.dim == 0 or self.n * self.dim > _I32_MAX:  # as a list<float> holds it
                return False
            self.values = np.empty(self.n * self.dim, dtype=np.float32)
        if np.any(lengths != self.dim):
            return False
        at = self.rows * self.dim
        self.values[at : at + len(flat)] = flat.to_numpy()
        self.rows += len(chunk)
        return True

    def array(self) -> pa.Array:
        """The rows packed so far as one list array of the column's type (no copy)."""
        if self.values is None:
            return pa.array([], type=self.type)
        offsets = np.arange(0, (self.rows + 1) * self.dim, self.dim, dtype=np.int32)
        items = pa.array(self.values[: self.rows * self.dim])
        return pa.ListArray.from_arrays(pa.array(offsets), items, type=self.type)


def _groups(
    path: Path, pf: pq.ParquetFile, fields: list[str], workers: int
) -> Iterator[tuple[int, pa.Table]]:
    """(row group, its table) in order, up to `workers` groups decoded at once, each by
    its own thread's reader of the file."""
    local = threading.local()

    def read(group: int) -> pa.Table:
        if not hasattr(local, "file"):
            local.file = pq.ParquetFile(path)
        return local.file.read_row_group(group, columns=fields, use_threads=False)

    if workers <= 1 or pf.num_row_groups <= 1:
        for group in range(pf.num_row_groups):
            yield group, pf.read_row_group(group, columns=fields)
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
    workers = max(1, pa.cpu_count())  # row groups decoded at once, one per Arrow thread
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
        parts = chunks.pop(f)
        column = pa.chunked_array(parts, type=schema.field(f).type)
        del parts
        out[f] = column.combine_chunks()
    return out
