"""tl/model/gguf_file.py against gguf-py's GGUFReader, an independent reader of the same files:
every value type and tensor layout of a file written here with gguf.GGUFWriter (and the real
SmolLM2 file, slow) reads to the same keys, values, Python types, tensor names, types, shapes,
dtypes and bytes; a damaged file (cut anywhere, a duplicate key or tensor, a big-endian or
unknown version, an unknown value or tensor type, a bad alignment) is a ValueError saying what is
wrong, and through open_gguf a GGUFError naming the file.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from tl.model.gguf_file import GGUFFile
from tl.model.gguf_model import GGUFError, open_gguf

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType


def _write(path: Path, *, alignment: int | None = None) -> Path:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_uint32("general.alignment", alignment)
    scalars = [
        (V.UINT8, 200),
        (V.INT8, -7),
        (V.UINT16, 60000),
        (V.INT16, -30000),
        (V.UINT32, 4_000_000_000),
        (V.INT32, -2_000_000_000),
        (V.FLOAT32, 0.1),
        (V.BOOL, True),
        (V.UINT64, 2**63 + 5),
        (V.INT64, -(2**62)),
        (V.FLOAT64, 0.1),
        (V.STRING, "héllo ▁ 世界"),
    ]
    for vtype, val in scalars:
        w.add_key_value(f"t.scalar.{vtype.name.lower()}", val, vtype)
        if vtype != V.STRING:
            w.add_key_value(f"t.array.{vtype.name.lower()}", [val, val, val], V.ARRAY, sub_type=vtype)
    w.add_key_value("t.array.bools", [True, False, True], V.ARRAY, sub_type=V.BOOL)
    w.add_key_value("t.array.strings", ["a", "", "▁é", "x" * 300], V.ARRAY, sub_type=V.STRING)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f32_vector", rng.standard_normal(64).astype(np.float32))
    w.add_tensor("f32_3d", rng.standard_normal((2, 3, 32)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 32)).astype(np.float16))
    w.add_tensor("i32", rng.integers(-5, 5, (2, 8)).astype(np.int32))
    x = rng.standard_normal((5, 256)).astype(np.float32)
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.BF16):
        w.add_tensor(qtype.name.lower(), gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.add_tensor("q4_k", rng.integers(0, 256, (5, 144), dtype=np.uint8), raw_dtype=Q.Q4_K)  # one super-block a row
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _same_as_gguf_py(path: Path) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # its header entries are not metadata
    assert list(ours.fields) == keys
    for k in keys:
        a, b = ours.fields[k], theirs.fields[k].contents()
        assert a == b and type(a) is type(b), (k, a, b)
        if isinstance(a, list):
            assert [type(v) for v in a] == [type(v) for v in b], k
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == int(b.tensor_type) and a.shape == tuple(int(d) for d in b.shape), a.name
        assert (a.data.dtype, a.data.shape) == (b.data.dtype, b.data.shape), a.name
        assert a.data.tobytes() == np.asarray(b.data).tobytes(), a.name
        assert a.n_elements == b.n_elements
    assert (ours.data_offset, ours.alignment) == (theirs.data_offset, theirs.alignment)
    # entry_bytes: each entry as stored, back to back from byte 24 (after magic, version, counts)
    entries = [ours.entry_bytes(k) for k in keys]
    assert all(e[8 : 8 + len(k.encode())] == k.encode() for k, e in zip(keys, entries, strict=True))
    stored = path.read_bytes()
    assert b"".join(entries) == stored[24 : 24 + sum(map(len, entries))]
    assert all(
        theirs.fields[k].offset == 24 + sum(map(len, entries[:i])) for i, k in enumerate(keys)
    )  # gguf-py's own offset of each field
    return ours


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_and_tensor_type_reads_as_gguf_py_reads_it(tmp_path: Path, alignment: int | None) -> None:
    f = _same_as_gguf_py(_write(tmp_path / "t.gguf", alignment=alignment))
    assert f.field("t.scalar.float32") == float(np.float32(0.1)) and f.field("t.scalar.float64") == 0.1
    assert f.field("t.array.strings") == ["a", "", "▁é", "x" * 300] and f.field("t.absent", 7) == 7
    assert not f.tensors[0].data.flags.writeable  # a view of the file, not a copy


@pytest.mark.slow
def test_the_real_smollm2_file_reads_as_gguf_py_reads_it(smol_gguf: Path) -> None:
    f = _same_as_gguf_py(smol_gguf)
    assert len(f.field("tokenizer.ggml.tokens")) == 49152 and len(f.tensors) == 272


def test_an_empty_array_reads_as_an_empty_list(tmp_path: Path) -> None:
    (tmp_path / "e.gguf").write_bytes(_header(kv=_kv("a", 9, struct.pack("<IQ", 5, 0))))
    assert GGUFFile(tmp_path / "e.gguf").fields == {"a": []}


def test_a_file_cut_anywhere_is_a_clear_error(tmp_path: Path) -> None:
    whole = _write(tmp_path / "t.gguf").read_bytes()
    f, theirs = GGUFFile(tmp_path / "t.gguf"), gguf.GGUFReader(str(tmp_path / "t.gguf"))
    end = theirs.tensors[-1].data_offset + theirs.tensors[-1].n_bytes  # the last tensor's end (padding follows)
    cut_points = sorted(set(range(0, f.data_offset, 7)) | {f.data_offset - 1, end - 1, end - 40})
    for n in cut_points:
        (tmp_path / "cut.gguf").write_bytes(whole[:n])
        with pytest.raises(ValueError, match="past the end of the file|bad magic"):
            GGUFFile(tmp_path / "cut.gguf")
    with pytest.raises(GGUFError, match=r"cut.gguf: malformed GGUF \(ValueError: tensor 'q4_k'"):
        open_gguf(tmp_path / "cut.gguf")


def _header(version: int = 3, n_tensors: int = 0, kv: bytes = b"", n_kv: int = 1) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + kv


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vtype) + payload


def _tensor_info(name: str, dims: tuple[int, ...], ttype: int, offset: int) -> bytes:
    head = struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", len(dims))
    return head + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", ttype, offset)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_header(kv=_kv("a", 4, b"\1\0\0\0") + _kv("a", 4, b"\2\0\0\0"), n_kv=2), "duplicate metadata key 'a'"),
        (_header(version=0x03000000, n_kv=0), "a big-endian file is not supported"),
        (_header(version=1, n_kv=0), "version 1 is not supported"),
        (_header(kv=_kv("a", 13, b"")), "metadata value 'a': unknown value type 13"),
        (_header(kv=_kv("a", 9, struct.pack("<IQ", 14, 1))), "metadata value 'a': unknown value type 14"),
        (_header(kv=_kv("general.alignment", 4, struct.pack("<I", 48))), "general.alignment 48 is not a power of two"),
        (_header(kv=_kv("general.alignment", 4, struct.pack("<I", 0))), "general.alignment 0 is not a power of two"),
        (_header(kv=_kv("a", 8, struct.pack("<Q", 2) + b"\xff\xfe")), "can't decode"),
        (
            _header(n_tensors=1, n_kv=0) + _tensor_info("w", (4,), 99, 0) + bytes(64),
            "tensor 'w' has unknown type id 99",
        ),
        (_header(n_tensors=1, n_kv=0) + _tensor_info("w", (33,), int(Q.Q8_0), 0) + bytes(64), "not whole blocks of 32"),
        (
            _header(n_tensors=2, n_kv=0) + _tensor_info("w", (4,), 0, 0) + _tensor_info("w", (4,), 0, 32) + bytes(96),
            "duplicate tensor 'w'",
        ),
        (_header(n_tensors=1, n_kv=0) + _tensor_info("w", (64,), 0, 0) + bytes(100), "tensor 'w' .* past the end"),
    ],
)
def test_a_damaged_file_says_what_is_wrong(tmp_path: Path, data: bytes, message: str) -> None:
    (tmp_path / "bad.gguf").write_bytes(data)
    with pytest.raises(ValueError, match=message):
        GGUFFile(tmp_path / "bad.gguf")
    with pytest.raises(GGUFError, match="bad.gguf: malformed GGUF"):
        open_gguf(tmp_path / "bad.gguf")
