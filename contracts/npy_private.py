"""One `.npy` file read into private memory: how the server loads the index arrays it
serves (`read_index_dir(..., mmap=False)`, docs/FORMAT.md "How the server reads a
version"). The file is read once into a buffer of its size, its sha256 (when given) taken
over exactly those bytes, and the array built over the buffer from the header parsed
there: no second copy, and nothing done to the file afterwards (truncation, an overwrite
in place) can reach the array — a memory map would raise SIGBUS or serve the new bytes.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
from pathlib import Path

import numpy as np


class NpyError(ValueError):
    """The file is no readable .npy, or its checksum differs."""


def load_npy_private(path: Path, sha256: str | None = None) -> np.ndarray:
    """A `.npy` file read once into private memory, as a read-only array over that buffer
    (the module docstring says why); NpyError for a bad file or checksum."""
    buf = _read_file(path)
    if sha256 is not None and hashlib.sha256(buf).hexdigest() != sha256:
        raise NpyError(f"{path}: checksum mismatch (corrupted or truncated)")
    try:
        dtype, shape, fortran, offset = _npy_header(buf)
    except ValueError as exc:
        raise NpyError(f"{path}: unreadable array: {exc}") from exc
    if dtype.hasobject:
        raise NpyError(f"{path}: unreadable array: holds Python objects")
    count = math.prod(shape)
    if len(buf) - offset < count * dtype.itemsize:
        raise NpyError(
            f"{path}: unreadable array: {len(buf) - offset} data bytes for {count} x {dtype}"
        )
    flat = np.frombuffer(buf, dtype=dtype, count=count, offset=offset)
    arr = flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)
    arr.flags.writeable = False
    return arr


def _read_file(path: Path) -> bytearray:
    """The whole file in one buffer of its size (no growing copies); short if it shrank."""
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(os.fstat(fh.fileno()).st_size)
        done = 0
        with memoryview(buf) as view:
            while done < len(buf):
                got = fh.readinto(view[done:])
                if not got:
                    break
                done += got
    del buf[done:]
    return buf


def _npy_header(buf: bytearray) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """(dtype, shape, fortran_order, data offset) of a .npy file held in `buf`."""
    if len(buf) < 10 or bytes(buf[:6]) != np.lib.format.MAGIC_PREFIX:
        raise ValueError("not a .npy file")
    major = buf[6]
    if major not in (1, 2):
        raise ValueError(f".npy format version {major} is not supported")
    size_bytes = 2 if major == 1 else 4
    end = 8 + size_bytes + int.from_bytes(buf[8 : 8 + size_bytes], "little")
    if end > len(buf):
        raise ValueError("header runs past the end of the file")
    fp = io.BytesIO(bytes(buf[:end]))
    npy = np.lib.format
    npy.read_magic(fp)
    read = npy.read_array_header_1_0 if major == 1 else npy.read_array_header_2_0
    shape, fortran, dtype = read(fp)
    return dtype, tuple(shape), bool(fortran), end
