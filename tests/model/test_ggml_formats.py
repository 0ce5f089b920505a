"""ggml's block formats (tl/model/encodings/ggml_formats.py) against gguf-py's numpy
(gguf.quants, written to match ggml-quants.c) as the independent reference:

- geometry: every format's block size and bytes as gguf.GGML_QUANT_SIZES, lookup by GGUF type,
  row_bytes refusing a width that is not a multiple of the block;
- the jitted `dequantize` bit for bit gguf.quants.dequantize, for every format, on rows that
  gguf-py quantized from random floats (the 32-blocks) and on random raw blocks (every format,
  K-quants included: random bytes with finite float16 scales, small and subnormal ones too),
  with leading dims [3, 2, row_bytes] and as a single row;
- `quantize` equal to gguf.quants.quantize, and refusing the K-quants, unknown names and bad
  widths.
"""

from __future__ import annotations

import gguf
import jax
import numpy as np
import pytest
from gguf.quants import dequantize as ref_dequantize
from gguf.quants import quantize as ref_quantize

from tl.model.encodings.ggml_formats import FORMATS, QUANTIZABLE, by_ggml_type, dequantize, get, quantize, row_bytes

_deq = jax.jit(dequantize, static_argnums=0)

# Byte offsets of each block's float16 scales (d, and m / dmin where the format has one).
F16_AT = {
    "q4_0": (0,),
    "q4_1": (0, 2),
    "q5_0": (0,),
    "q5_1": (0, 2),
    "q8_0": (0,),
    "q4_k": (0, 2),
    "q5_k": (0, 2),
    "q6_k": (208,),
    "f16": (0,),
    "bf16": (),
}


def _ref_deq(raw: np.ndarray, name: str) -> np.ndarray:
    """gguf-py's dequantization of raw bytes (its F16 reads float16 values, not bytes)."""
    return ref_dequantize(raw.view(np.float16) if name == "f16" else raw, _qtype(name))


def _ref_q(w: np.ndarray, name: str) -> np.ndarray:
    return np.asarray(ref_quantize(w, _qtype(name))).view(np.uint8)


def _qtype(name: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType(FORMATS[name].ggml_type)


def _random_blocks(name: str, lead: tuple[int, ...], nb: int, seed: int) -> np.ndarray:
    """Random raw rows uint8 [*lead, nb * block_bytes] whose float16 fields are finite: mostly
    moderate (|x| in [2^-10, 4)), some tiny, some float16 subnormals, some zero."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (*lead, nb, fmt.block_bytes), dtype=np.uint8)
    for at in F16_AT[name]:
        mag = 2.0 ** rng.uniform(-10, 2, (*lead, nb))
        kind = rng.integers(0, 8, (*lead, nb))
        mag = np.where(kind == 0, 2.0 ** rng.uniform(-24, -14, (*lead, nb)), mag)  # subnormal
        mag = np.where(kind == 1, 0.0, mag)
        f16 = (mag * rng.choice([-1.0, 1.0], (*lead, nb))).astype(np.float16)
        blocks[..., at : at + 2] = f16[..., None].view(np.uint8)
    if name == "bf16":  # finite bfloat16s: the top halves of finite float32s
        f32 = (rng.standard_normal((*lead, nb)) * 2.0 ** rng.uniform(-20, 20, (*lead, nb))).astype(np.float32)
        blocks[...] = (f32.view(np.uint32) >> 16).astype(np.uint16)[..., None].view(np.uint8)
    return blocks.reshape(*lead, nb * fmt.block_bytes)


def test_geometry() -> None:
    assert list(FORMATS) == ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "f16", "bf16"]
    for name, fmt in FORMATS.items():
        t = _qtype(name)
        assert t.name.lower() == name
        assert (fmt.block_size, fmt.block_bytes) == gguf.GGML_QUANT_SIZES[t]
        assert by_ggml_type(int(t)) is fmt
        assert row_bytes(fmt, 3 * fmt.block_size) == 3 * fmt.block_bytes
    assert FORMATS["q4_k"].block_size == 256 and FORMATS["q6_k"].block_bytes == 210
    assert by_ggml_type(int(gguf.GGMLQuantizationType.F16)) is FORMATS["f16"]
    assert FORMATS["bf16"].block_size == 1 and FORMATS["bf16"].block_bytes == 2
    assert by_ggml_type(int(gguf.GGMLQuantizationType.F32)) is None
    with pytest.raises(ValueError, match="blocks of 32 inputs: n_in=100 "):
        row_bytes(FORMATS["q4_0"], 100)
    with pytest.raises(ValueError, match="256") as e:
        row_bytes(FORMATS["q6_k"], 512 + 32)
    assert "n_in=544" in str(e.value)
    with pytest.raises(ValueError, match="q3_k"):
        get("q3_k")


@pytest.mark.parametrize("name", list(FORMATS))
def test_dequantize_random_blocks_bit_exact(name: str) -> None:
    for lead, nb, seed in (((3, 2), 4, 0), ((), 3, 1), ((1,), 1, 2)):
        raw = _random_blocks(name, lead, nb, seed)
        want = _ref_deq(raw, name)
        got = np.asarray(_deq(name, raw))
        assert got.dtype == np.float32 and got.shape == (*lead, nb * FORMATS[name].block_size)
        assert np.isfinite(want).all()
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_quantize_then_dequantize_matches_gguf(name: str) -> None:
    rng = np.random.default_rng(7)
    w = rng.standard_normal((3, 2, 4 * 32)).astype(np.float32) * rng.uniform(0.01, 3, (3, 2, 1)).astype(np.float32)
    w[0, 0, :32] = 0.0  # an all-zero block (d = 0)
    w[0, 1, 32:64] = 5.0  # a constant block (q4_1 / q5_1: d = 0, m = 5)
    raw = quantize(name, w)
    np.testing.assert_array_equal(raw, _ref_q(w, name))
    assert raw.dtype == np.uint8 and raw.shape == (3, 2, row_bytes(FORMATS[name], 128))
    want = _ref_deq(raw, name)
    np.testing.assert_array_equal(np.asarray(_deq(name, raw)), want)
    np.testing.assert_array_equal(np.asarray(_deq(name, raw[1, 0])), want[1, 0])  # a single row
    assert np.abs(want - w).max() <= np.abs(w).max() / 6  # it is a quantization of w


def test_quantize_refusals() -> None:
    w = np.ones((2, 256), np.float32)
    for name in ("q4_k", "q5_k", "q6_k"):
        with pytest.raises(ValueError, match=name) as e:
            quantize(name, w)
        assert "q8_0" in str(e.value)  # it says which formats can
    with pytest.raises(ValueError, match="n_in=48"):
        quantize("q8_0", np.ones((2, 48), np.float32))
    with pytest.raises(ValueError, match="iq2_xs"):
        quantize("iq2_xs", w)


def test_dequantize_refuses_partial_blocks() -> None:
    with pytest.raises(ValueError, match="34"):
        dequantize("q8_0", jax.numpy.zeros((2, 35), jax.numpy.uint8))
