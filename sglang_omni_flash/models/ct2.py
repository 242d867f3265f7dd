"""Reader for CTranslate2 `model.bin` files (binary format version 6).

Layout, little-endian; a `str` is `u16 length` (counting a trailing NUL) then the bytes:

    u32 version            (6)
    str spec_name          ("WhisperSpec" for Whisper)
    u32 revision
    u32 n_vars
    n_vars x { str name, u8 rank, u32 dims[rank], u8 dtype, u32 nbytes, bytes data }
    u32 n_aliases
    n_aliases x { str alias, str target }

The file is read front to back, one variable at a time (a Whisper base file is 145 MB), and
every count and size is checked against what the file can hold, so a truncated or corrupted
file is reported as a `UserError` that says where it broke, never as a numpy or struct error.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from sglang_omni_flash.errors import UserError

SUPPORTED_VERSION = 6

# CTranslate2's DataType enum. bfloat16 has no numpy dtype: it is widened to float32, which is
# exact (a bfloat16 is the top half of a float32).
_DTYPES: dict[int, np.dtype] = {
    0: np.dtype("<f4"),
    1: np.dtype("i1"),
    2: np.dtype("<i2"),
    3: np.dtype("<i4"),
    4: np.dtype("<f2"),
    5: np.dtype("<u2"),  # bfloat16 bits
}
_BFLOAT16 = 5

# Bounds no real model reaches; a value past them means the bytes are not what we think.
_MAX_RANK = 8
_MAX_NAME_BYTES = 4096


@dataclass
class Ct2Model:
    """The whole content of a model.bin: header fields, named arrays and name aliases."""

    path: Path
    spec_name: str
    revision: int
    variables: dict[str, np.ndarray] = field(repr=False)
    # alias -> name of the variable it shares storage with (e.g. a tied output projection)
    aliases: dict[str, str]

    def get(self, name: str) -> np.ndarray:
        """A variable by name, following an alias."""
        return self.variables[self.aliases.get(name, name)]


class _Stream:
    """Reads exact byte counts and turns a short read into a `UserError` naming the place."""

    def __init__(self, handle: BinaryIO, path: Path, on_bytes: Callable[[int], None] | None):
        self._handle = handle
        self._path = path
        self._on_bytes = on_bytes
        self.offset = 0
        self.size = path.stat().st_size

    def fail(self, what: str) -> UserError:
        return UserError(f"{self._path}: not a valid CTranslate2 model.bin: {what} (at byte {self.offset:,})")

    def read(self, count: int, what: str) -> bytes:
        if count > self.size - self.offset:
            raise self.fail(
                f"file is truncated: {what} needs {count:,} bytes but only {self.size - self.offset:,} remain"
            )
        data = self._handle.read(count)
        if len(data) != count:  # the file shrank while we read it
            raise self.fail(f"file is truncated: short read of {what}")
        self.offset += count
        if self._on_bytes is not None:
            self._on_bytes(count)
        return data

    def u8(self, what: str) -> int:
        return self.read(1, what)[0]

    def u16(self, what: str) -> int:
        return struct.unpack("<H", self.read(2, what))[0]

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.read(4, what))[0]

    def string(self, what: str) -> str:
        length = self.u16(f"length of {what}")
        if length <= 1 or length > _MAX_NAME_BYTES:  # 1 would be an empty string
            raise self.fail(f"{what} has an impossible length {length}")
        raw = self.read(length, what)
        if raw[-1] != 0 or 0 in raw[:-1]:
            raise self.fail(f"{what} is not a NUL-terminated string")
        try:
            return raw[:-1].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None


def read_model_bin(path: str | Path, on_bytes: Callable[[int], None] | None = None) -> Ct2Model:
    """Read a CTranslate2 v6 `model.bin` into numpy arrays.

    `on_bytes(n)` is called after each read of `n` bytes (for a progress bar; the total is
    the file size). Raises `UserError` for a missing, truncated or corrupted file.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file (expected a CTranslate2 model.bin)")
    with path.open("rb") as handle:
        stream = _Stream(handle, path, on_bytes)
        version = stream.u32("format version")
        if version != SUPPORTED_VERSION:
            raise stream.fail(
                f"format version {version}, only version {SUPPORTED_VERSION} is supported "
                "(re-export it with a recent ct2-transformers-converter)"
            )
        spec_name = stream.string("spec name")
        revision = stream.u32("spec revision")
        n_vars = stream.u32("variable count")
        # the smallest variable (name of 1 char, rank 0, 1 byte) takes 2+2+1+1+4+1 = 11 bytes
        if n_vars * 11 > stream.size - stream.offset:
            raise stream.fail(f"header announces {n_vars:,} variables, more than the file can hold")

        variables: dict[str, np.ndarray] = {}
        for index in range(n_vars):
            where = f"variable {index + 1} of {n_vars}"
            name = stream.string(f"name of {where}")
            where = f"{where} ({name!r})"
            if name in variables:
                raise stream.fail(f"{where} appears twice")
            variables[name] = _read_array(stream, where)

        n_aliases = stream.u32("alias count (the variable count in the header may be wrong)")
        if n_aliases * 6 > stream.size - stream.offset:
            raise stream.fail(
                f"alias count {n_aliases:,} is more than the file can hold "
                f"(is the variable count {n_vars} in the header right?)"
            )
        aliases: dict[str, str] = {}
        for index in range(n_aliases):
            alias = stream.string(f"alias {index + 1} of {n_aliases}")
            target = stream.string(f"target of alias {alias!r}")
            if target not in variables:
                raise stream.fail(f"alias {alias!r} points to unknown variable {target!r}")
            aliases[alias] = target

        if stream.offset != stream.size:
            raise stream.fail(f"{stream.size - stream.offset:,} unexpected bytes after the last alias")
    return Ct2Model(path=path, spec_name=spec_name, revision=revision, variables=variables, aliases=aliases)


def _read_array(stream: _Stream, where: str) -> np.ndarray:
    rank = stream.u8(f"rank of {where}")
    if rank > _MAX_RANK:
        raise stream.fail(f"{where} has rank {rank}")
    shape = tuple(stream.u32(f"shape of {where}") for _ in range(rank))
    dtype_id = stream.u8(f"dtype of {where}")
    if dtype_id not in _DTYPES:
        raise stream.fail(f"{where} has unknown dtype id {dtype_id} (known: {sorted(_DTYPES)})")
    dtype = _DTYPES[dtype_id]
    nbytes = stream.u32(f"byte count of {where}")
    expected = math.prod(shape) * dtype.itemsize
    if nbytes != expected:
        raise stream.fail(
            f"{where}: {nbytes:,} bytes stored but shape {list(shape)} x {dtype} needs {expected:,}"
        )
    # copy out of the read buffer so the array is writable and owns its memory
    array = np.frombuffer(stream.read(nbytes, f"data of {where}"), dtype=dtype).reshape(shape).copy()
    if dtype_id == _BFLOAT16:
        array = (array.astype(np.uint32) << 16).view(np.float32)
    return array
