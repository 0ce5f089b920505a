"""GGUF (version 3) written as a stream, with metadata entries copied byte for byte from another file.

Owns: `TensorInfo` and `write_head` (magic, counts, metadata, tensor table, padding: after it a
writer appends each tensor's bytes, `pad` between them); entries copied from another file come
as their stored bytes (tl/model/gguf_file.py `GGUFFile.entry_bytes`).
Why not gguf-py's writer: it packs an array item by item; copying the tokenizer's entries as
bytes keeps every value and type exactly as the shipped file has them. Tensor data is
appended as it is made, so a file never has to fit in memory.
Must not know model layouts or quantize. Tested by tests/bench/test_synth.py (files read back
with gguf.GGUFReader).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import BinaryIO

import gguf

ALIGNMENT = 32  # general.alignment's default, which these files keep
STRING = 8  # GGUF value type of a string


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One row of the tensor table: `shape` in numpy order (the file stores it reversed)."""

    name: str
    shape: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType
    nbytes: int


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
