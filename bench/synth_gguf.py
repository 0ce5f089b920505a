"""GGUF (version 3) written as a stream, with metadata entries copied byte for byte from another file.

Owns: `raw_entries` (the metadata entries of a GGUF whose keys start with a prefix, each as its
bytes in the file: key, value type, value), `array_length` (the item count of an array entry),
`TensorInfo` and `write_head` (magic, counts, metadata, tensor table, padding: after it a
writer appends each tensor's bytes, `pad` between them).
Why not gguf-py: its reader takes ~20 s to open a file with Gemma 3's 262,144-token vocabulary
(a numpy view per value) and its writer packs an array item by item; copying the tokenizer's
entries as bytes keeps every value and type exactly as the shipped file has them and costs one
pass. Tensor data is appended as it is made, so a file never has to fit in memory.
Must not know model layouts or quantize. Tested by tests/bench/test_synth.py (files read back
with gguf.GGUFReader).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import gguf

ALIGNMENT = 32  # general.alignment's default, which these files keep
STRING, ARRAY = 8, 9
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One row of the tensor table: `shape` in numpy order (the file stores it reversed)."""

    name: str
    shape: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType
    nbytes: int


def _skip(buf: mmap.mmap, at: int, vtype: int) -> int:
    """The offset just past a value of `vtype` starting at `at`."""
    if vtype in _SIZES:
        return at + _SIZES[vtype]
    if vtype == STRING:
        return at + 8 + struct.unpack_from("<Q", buf, at)[0]
    if vtype != ARRAY:
        raise ValueError(f"unknown GGUF value type {vtype} at byte {at}")
    itype, count = struct.unpack_from("<IQ", buf, at)
    at += 12
    if itype in _SIZES:
        return at + count * _SIZES[itype]
    for _ in range(count):
        at = _skip(buf, at, itype)
    return at


def raw_entries(path: Path, prefix: str) -> dict[str, bytes]:
    """Every metadata entry of the GGUF at `path` whose key starts with `prefix`, as its bytes."""
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF" or struct.unpack_from("<I", data, 4)[0] != 3:
            raise ValueError(f"{path}: not a version 3 little-endian GGUF")
        n_kv = struct.unpack_from("<Q", data, 16)[0]
        at, out = 24, {}
        for _ in range(n_kv):
            start, n = at, struct.unpack_from("<Q", data, at)[0]
            key = data[at + 8 : at + 8 + n].decode()
            at = _skip(data, at + 12 + n, struct.unpack_from("<I", data, at + 8 + n)[0])
            if key.startswith(prefix):
                out[key] = data[start:at]
        return out


def array_length(entry: bytes) -> int:
    """The item count of a raw array entry."""
    n = struct.unpack_from("<Q", entry, 0)[0]
    vtype, _, count = struct.unpack_from("<IIQ", entry, 8 + n)
    if vtype != ARRAY:
        raise ValueError("not an array entry")
    return int(count)


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _entry(key: str, value: object) -> bytes:
    """A typed entry: bool BOOL, int UINT32, float FLOAT32, str STRING (llama.cpp's key types)."""
    if isinstance(value, bool):
        return _string(key) + struct.pack("<I?", 7, value)
    if isinstance(value, int):
        return _string(key) + struct.pack("<II", 4, value)
    if isinstance(value, float):
        return _string(key) + struct.pack("<If", 6, value)
    if isinstance(value, str):
        return _string(key) + struct.pack("<I", STRING) + _string(value)
    raise TypeError(f"metadata {key!r}: {type(value).__name__} values are not written")


def write_head(f: BinaryIO, fields: dict[str, object], raw: dict[str, bytes], tensors: list[TensorInfo]) -> None:
    """Header, `fields` (typed as `_entry` says) then `raw` entries, the tensor table (each
    tensor at the next multiple of ALIGNMENT after the one before), and padding to the data."""
    f.write(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(fields) + len(raw)))
    f.write(b"".join(_entry(k, v) for k, v in fields.items()) + b"".join(raw.values()))
    offset = 0
    for t in tensors:
        dims = tuple(reversed(t.shape))
        f.write(_string(t.name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, int(t.qtype), offset))
        offset += -(-t.nbytes // ALIGNMENT) * ALIGNMENT
    pad(f)


def pad(f: BinaryIO) -> None:
    """Zeros up to the next multiple of ALIGNMENT (where the next tensor starts)."""
    f.write(bytes(-f.tell() % ALIGNMENT))
