"""A GGUF file's metadata and tensor table, read in one pass over the mapped file.

Owns: `GGUFFile` (the key/value metadata as Python values: scalars, strings, lists, and each
entry's bytes as stored, `entry_bytes`; the tensor
table as `GGUFTensor`s whose `data` are views of the mapping, shaped and typed as gguf-py's
ReaderTensor.data: F32 / F16 / F64 / I8-I64 as their numpy types in numpy order, every other
type its bytes, uint8 [*rows, row_bytes]) and the checks a damaged file fails (bad magic, an
unsupported version, a big-endian file, a value or tensor past the end of the file, a duplicate
key or tensor name, an unknown value or tensor type, a bad alignment): ValueError naming what is
wrong, which tl/model/gguf_model.py `open_gguf` turns into GGUFError naming the file.
Must not: interpret the metadata (tl/model/gguf_model.py, tl/model/gguf_tokenizer.py do).
Tested by tests/model/test_gguf_file.py against gguf-py's GGUFReader on the same files.

Why not gguf-py's reader: it makes a numpy view for every part of every value, and a
tokenizer's vocabulary is hundreds of thousands of values (Gemma 3: 262,144 tokens, scores and
types): 20.3 s to open Gemma 3 270M's GGUF and 4.9 s for SmolLM2-135M's on a 2-core Zen 3,
paid at every start of a server. Here the strings are decoded in one loop and numeric arrays
are one `np.frombuffer` each.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # gguf-py's reader's; version 1 had 32-bit counts
DEFAULT_ALIGNMENT = 32

# GGUF value types: id -> (struct code, numpy dtype); 8 is a string, 9 an array.
STRING, ARRAY = 8, 9
SCALARS: dict[int, tuple[str, Any]] = {
    0: ("B", np.uint8),
    1: ("b", np.int8),
    2: ("H", np.uint16),
    3: ("h", np.int16),
    4: ("I", np.uint32),
    5: ("i", np.int32),
    6: ("f", np.float32),
    7: ("?", np.bool_),
    10: ("Q", np.uint64),
    11: ("q", np.int64),
    12: ("d", np.float64),
}
# Tensor types read as their own numpy type (gguf-py's choice); the rest as bytes.
NUMPY_TENSORS = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    tensor_type: int  # ggml's type id (GGMLQuantizationType)
    shape: tuple[int, ...]  # GGUF order: the row length first
    data: np.ndarray  # a read-only view of the mapped file

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class _Cursor:
    """Reads little-endian values from `buf` at `at`, refusing to pass its end."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.at, self.size = buf, 0, len(buf)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.at + n > self.size:
            raise ValueError(f"{what} at byte {self.at} runs past the end of the file ({self.size} bytes)")

    def scalar(self, code: str, what: str) -> Any:
        n = struct.calcsize("<" + code)
        self.need(n, what)
        (v,) = struct.unpack_from("<" + code, self.buf, self.at)
        self.at += n
        return v

    def string(self, what: str) -> str:
        n = self.scalar("Q", what)
        self.need(n, what)
        s = self.buf[self.at : self.at + n].decode("utf-8")
        self.at += n
        return s

    def strings(self, count: int, what: str) -> list[str]:
        buf, at, size, out = self.buf, self.at, self.size, []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if at + 8 > size:
                raise ValueError(f"{what} at byte {at} runs past the end of the file ({size} bytes)")
            (n,) = unpack(buf, at)
            if at + 8 + n > size:
                raise ValueError(f"{what} at byte {at} runs past the end of the file ({size} bytes)")
            out.append(buf[at + 8 : at + 8 + n].decode("utf-8"))
            at += 8 + n
        self.at = at
        return out

    def array(self, dtype: Any, count: int, what: str) -> np.ndarray:
        n = np.dtype(dtype).itemsize * count
        self.need(n, what)
        a = np.frombuffer(self.buf, dtype=np.dtype(dtype).newbyteorder("<"), count=count, offset=self.at)
        self.at += n
        return a

    def value(self, vtype: int, what: str) -> Any:
        if vtype == STRING:
            return self.string(what)
        if vtype in SCALARS:
            return self.scalar(SCALARS[vtype][0], what)
        if vtype != ARRAY:
            raise ValueError(f"{what}: unknown value type {vtype}")
        itype, count = self.scalar("I", what), self.scalar("Q", what)
        if itype == STRING:
            return self.strings(count, what)
        if itype in SCALARS:
            return self.array(SCALARS[itype][1], count, what).tolist()
        return [self.value(itype, what) for _ in range(count)]  # arrays of arrays


class GGUFFile:
    """The GGUF at `path`: `fields` (key -> value), `tensors` (file order), `alignment`,
    `data_offset`. ValueError for a damaged or unsupported file. The mapping stays open while
    any tensor's data is referenced."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            if f.read(4) != MAGIC:
                raise ValueError("bad magic (not a GGUF file)")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        c = _Cursor(self._map)
        c.at = 4
        version = c.scalar("I", "the version")
        if version not in VERSIONS:
            kind = "a big-endian file" if version & 0xFFFF == 0 else f"version {version}"
            raise ValueError(f"{kind} is not supported (versions {', '.join(map(str, VERSIONS))}, little-endian)")
        self.version = version
        n_tensors, n_kv = c.scalar("Q", "the tensor count"), c.scalar("Q", "the key count")
        self.fields: dict[str, Any] = {}
        self._spans: dict[str, tuple[int, int]] = {}  # key -> its entry's bytes (key, type, value)
        for _ in range(n_kv):
            start = c.at
            key = c.string("a metadata key")
            if key in self.fields:
                raise ValueError(f"duplicate metadata key {key!r}")
            self.fields[key] = c.value(c.scalar("I", f"the type of {key!r}"), f"metadata value {key!r}")
            self._spans[key] = (start, c.at)
        infos = []
        for _ in range(n_tensors):
            name = c.string("a tensor name")
            dims = c.array(np.uint64, c.scalar("I", f"tensor {name!r}'s dimension count"), f"tensor {name!r}'s shape")
            ttype, offset = c.scalar("I", f"tensor {name!r}'s type"), c.scalar("Q", f"tensor {name!r}'s offset")
            infos.append((name, tuple(int(d) for d in dims), ttype, offset))
        align = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
            raise ValueError(f"general.alignment {align!r} is not a power of two")
        self.alignment = align
        self.data_offset = -(-c.at // align) * align
        self.tensors: list[GGUFTensor] = []
        seen: set[str] = set()
        for name, shape, ttype, offset in infos:
            if name in seen:
                raise ValueError(f"duplicate tensor {name!r}")
            seen.add(name)
            self.tensors.append(self._tensor(name, shape, ttype, self.data_offset + offset))

    def _tensor(self, name: str, shape: tuple[int, ...], ttype: int, at: int) -> GGUFTensor:
        try:
            qtype = GGMLQuantizationType(ttype)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r} has unknown type id {ttype}") from None
        n = int(np.prod(shape, dtype=np.int64))
        if shape and shape[0] % block:
            raise ValueError(f"tensor {name!r}: a row of {shape[0]} is not whole blocks of {block} ({qtype.name})")
        np_dims = tuple(reversed(shape))
        dtype = NUMPY_TENSORS.get(qtype)
        if dtype is None:  # blocks (and BF16): the bytes, a row's worth last
            dtype, count = np.uint8, n // block * type_size
            np_dims = (*np_dims[:-1], np_dims[-1] // block * type_size) if np_dims else np_dims
        else:
            count = n
        nbytes = count * np.dtype(dtype).itemsize
        if at + nbytes > len(self._map):
            raise ValueError(f"tensor {name!r} ({nbytes} bytes at {at}) runs past the end of the file")
        data = np.frombuffer(self._map, dtype=dtype, count=count, offset=at).reshape(np_dims)
        return GGUFTensor(name, int(qtype), shape, data)

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value; `default` when the key is absent."""
        return self.fields.get(key, default)

    def entry_bytes(self, key: str) -> bytes:
        """The metadata entry `key` as stored (key, value type, value): what a writer copies to
        keep a value and its type exactly (bench/synth.py copies a shipped tokenizer). KeyError
        when absent."""
        start, end = self._spans[key]
        return self._map[start:end]
