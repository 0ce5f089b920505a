"""Block encodings (tl/model/encodings/blocks.py) and GGUFs served as they are.

- Quantized at load (weight_dtype "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"): the bytes are
  gguf-py's (the independent reference, written to match ggml-quants.c), and the model is the
  float model of the same dequantized values (XLA's path dequantizes inside the step).
- The XLA dot against a float64 product of gguf-py's dequantization, within gamma_K.
- A GGUF served as it is: a `.gguf` model_dir (and a directory keeping `model.gguf`), tensors
  kept in the file's formats with the file's bytes (mixed formats: q, k, v or gate, up not
  fused), K-quants included; the paged runner's greedy output is the dense float model's of the
  dequantized file; a tensor type tl does not serve is refused naming the tensor, its type and
  the types served; specs split the byte axis only at block boundaries.
The native integer-dot kernels: tests/kernels/test_cpu_native_quant.py. Tensor parallelism over block
weights: tests/runtime/tp_cases.py.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.quants import dequantize, quantize
from jax.sharding import PartitionSpec as P

from bench.kquants import quantize_q4_k, quantize_q6_k
from kernels import cpu_native
from tests.helpers.bounds import matmul_bound
from tests.helpers.gguf_writer import (
    CASES,
    MIXED,
    _k_config,
    write_model_gguf,
)
from tests.helpers.models import TINY, tiny_cfg, tiny_config, tiny_tensors
from tests.helpers.runner import ENGINE, dense_greedy, runner_greedy
from tl.model import llama, loader
from tl.model.config import ModelDirError
from tl.model.convert_gguf import convert_gguf, gguf_model_dir, model_dir_of
from tl.model.encodings.blocks import BLOCK_ENCODINGS, Blocks
from tl.model.encodings.ggml_formats import QUANTIZABLE
from tl.model.files import GGUF_FILE, read_tensors
from tl.model.gguf_model import GGUFError, Packed, packed_tensors
from tl.model.weights import Dense, partition_specs
from tl.runtime import backend, verdicts
from tl.runtime.runner import ModelRunner

Q = gguf.GGMLQuantizationType
_dense = jax.jit(llama.forward_dense, static_argnums=1)


def _round_trip(host: dict[str, np.ndarray], fmt: str) -> dict[str, np.ndarray]:
    t = Q[fmt.upper()]
    return {k: dequantize(quantize(v, t), t) if v.ndim == 2 else v for k, v in host.items()}


@pytest.mark.parametrize("fmt", QUANTIZABLE)
def test_quantized_at_load_is_the_float_model_of_the_same_values(fmt: str) -> None:
    """Every linear and the embedding in `fmt`, gguf-py's bytes; the logits those of the float
    model of the dequantized values (the XLA path dequantizes, then the same float32 dot)."""
    cfg = tiny_cfg(tied=fmt != "q4_0", bias=fmt == "q5_1")
    host = llama.init_params(cfg, jax.random.key(3))
    qw = loader.load_weights(host, cfg, weight_dtype=fmt)
    cls = BLOCK_ENCODINGS[fmt]
    assert isinstance(qw.embed, cls) and isinstance(qw.layers[0].wqkv, cls) and isinstance(qw.layers[1].w_down, cls)
    assert (qw.lm_head is None) == (fmt != "q4_0")
    down = host["model.layers.1.mlp.down_proj.weight"]
    np.testing.assert_array_equal(qw.layers[1].w_down.data, quantize(down, Q[fmt.upper()]).view(np.uint8))
    f32 = loader.load_weights(_round_trip(host, fmt), cfg)
    ids = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, 40), jnp.int32)
    want, got = np.asarray(_dense(f32, cfg, ids)[1]), np.asarray(_dense(qw, cfg, ids)[1])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def _gguf_view(raw: np.ndarray, fmt: str) -> np.ndarray:
    """Bytes as gguf-py's dequantize takes them: its F16 reads float16 values, the rest bytes."""
    return raw.view(np.float16) if fmt == "f16" else raw


@pytest.mark.parametrize("fmt", [*QUANTIZABLE, "q4_k", "q6_k"])
@pytest.mark.parametrize("rows", [1, 5])
def test_dot_within_gamma_k_of_the_exact_product(fmt: str, rows: int) -> None:
    rng = np.random.default_rng(rows)
    wf = rng.standard_normal((6, 2, 512)).astype(np.float32)
    raw = {"q4_k": quantize_q4_k, "q6_k": quantize_q6_k}.get(fmt, lambda x: quantize(x, Q[fmt.upper()]))(wf)
    w = BLOCK_ENCODINGS[fmt](np.asarray(raw).view(np.uint8).reshape(6, 2, -1), ())
    exact = np.asarray(dequantize(_gguf_view(np.asarray(w.data).reshape(12, -1), fmt), Q[fmt.upper()]), np.float64)
    x = rng.standard_normal((rows, 512)).astype(np.float32)
    got = np.asarray(jax.jit(llama.linear)(jnp.asarray(x), w), np.float64)
    assert got.shape == (rows, 6, 2)
    bound = matmul_bound(x, exact)  # XLA's path: the weights dequantized exactly, a float32 dot
    assert (np.abs(got.reshape(rows, 12) - x @ exact.T) <= bound).all()
    ids = jnp.asarray([3, 0, 11, 3], jnp.int32)
    table = BLOCK_ENCODINGS[fmt](np.asarray(w.data).reshape(12, -1), ())
    np.testing.assert_array_equal(np.asarray(table.rows(ids)), exact.astype(np.float32)[np.asarray(ids)])


def test_k_quants_cannot_be_made_at_load_but_are_served() -> None:
    with pytest.raises(ValueError, match="q4_k cannot be quantized at load"):
        BLOCK_ENCODINGS["q4_k"].encode(np.zeros((4, 256), np.float32), ())


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_served_as_it_is(tmp_path: Path, case: str) -> None:
    make_cfg, types = CASES[case]
    cfg = make_cfg()
    hf = tiny_tensors(cfg, seed=5)
    path = write_model_gguf(tmp_path / "tiny.Q.gguf", cfg, hf, types)
    d = gguf_model_dir(path, tmp_path / "cache")
    assert d.name == "tiny.Q" and (d / GGUF_FILE).resolve() == path.resolve() and not (d / "model.safetensors").exists()
    assert gguf_model_dir(path, tmp_path / "cache") == d  # written once
    packed = read_tensors(d)
    ref = read_tensors(convert_gguf(path, tmp_path / "f32", progress=False))  # the file dequantized
    w = loader.load_weights(packed, cfg, weight_dtype="auto")
    lp = w.layers[0]
    fmt = {k: t.name.lower() for k, t in types.items()}
    assert type(lp.w_down).__name__.lower() == fmt.get("ffn_down", "q8_0") and isinstance(lp.w_down, Blocks)
    fused_qkv = len({fmt.get(k, "q8_0") for k in ("attn_q", "attn_k", "attn_v")}) == 1
    assert (lp.wqkv is not None) == fused_qkv and (lp.w_gate_up is not None) == (fmt["ffn_gate"] == fmt["ffn_up"])
    reader = gguf.GGUFReader(str(path))
    raw_down = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight").data
    np.testing.assert_array_equal(lp.w_down.data, raw_down.view(np.uint8))  # the file's bytes, not re-encoded
    assert isinstance(w.embed, Blocks) and isinstance(w.final_norm.value, np.ndarray)
    f32 = loader.load_weights(ref, cfg)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, 24), jnp.int32)
    want, got = np.asarray(_dense(f32, cfg, ids)[1]), np.asarray(_dense(w, cfg, ids)[1])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    if case == "mixed":  # the verdicts' matmul chain over unfused layers (q/k/v, gate/up apart)
        lib = cpu_native.library()
        for call in verdicts.matmul_case(w.layers, w.head(), cfg, lib.matmul, 1, lib.argmax_lse).values():
            jax.block_until_ready(call())
    if case in ("mixed", "halves"):  # the paged runner over the .gguf file itself (halves: the native few-row kernel)
        engine = ENGINE.replace(
            model_dir=str(path), matmul_kernel="xla" if case == "mixed" else "cpu_native", native_cache_dir=""
        )
        runner = ModelRunner.from_model_dir(engine)
        assert isinstance(runner.params.layers[1].wv if case == "mixed" else runner.params.layers[1].wqkv, Blocks)
        assert (
            runner_greedy(runner, [3, 14, 15, 92, 65, 35, 89], 5)
            == dense_greedy(f32, cfg, [3, 14, 15, 92, 65, 35, 89], 5)[0]
        )


def test_a_type_tl_does_not_serve_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    cfg = _k_config()
    path = write_model_gguf(tmp_path / "k.gguf", cfg, tiny_tensors(cfg), {"ffn_up": Q.Q2_K})
    for load in (packed_tensors, lambda p: convert_gguf(p, tmp_path / "o", progress=False)):
        with pytest.raises(GGUFError) as e:
            load(path)
        msg = str(e.value)
        assert "k.gguf: tensor 'blk.0.ffn_up.weight' has type Q2_K, which tl does not serve" in msg
        assert "(served: F32, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16)" in msg
    assert not (tmp_path / "o" / "config.json").exists()


def test_model_dir_of_a_directory_is_itself_and_a_dir_keeping_a_gguf_serves_it(tmp_path: Path) -> None:
    cfg = tiny_config()
    hf = tiny_tensors(cfg, seed=1)
    path = write_model_gguf(tmp_path / "m.gguf", cfg, hf, {k: Q.Q4_1 for k in MIXED})
    d = convert_gguf(path, tmp_path / "m", progress=False, keep=True)
    assert (d / GGUF_FILE).is_file() and not path.exists() and model_dir_of(str(d)) == str(d)
    floats, packed = read_tensors(d), read_tensors(d, packed=True)
    assert isinstance(floats["model.layers.0.mlp.down_proj.weight"], np.ndarray)
    assert isinstance(packed["model.layers.0.mlp.down_proj.weight"], Packed)
    w = loader.load_weights(packed, cfg, weight_dtype="auto")
    assert type(w.layers[0].w_down).__name__ == "Q4_1"
    assert isinstance(loader.load_weights(floats, cfg, weight_dtype="auto").layers[0].w_down, Dense)
    as_float = loader.load_weights(packed, cfg, weight_dtype="float32")  # a GGUF dequantized on request
    np.testing.assert_array_equal(as_float.layers[0].w_down.w, floats["model.layers.0.mlp.down_proj.weight"])
    shutil.rmtree(d)


def test_specs_split_the_byte_axis_only_at_block_boundaries() -> None:
    """Column-parallel weights split by out. Row-parallel (split by in): wo's 64 inputs are 2
    blocks (split over 2 devices, whole over 4), w_down's 96 are 3 (whole either way)."""
    cfg = tiny_cfg()
    host = llama.init_params(cfg, jax.random.key(0))
    for n, wo in ((2, P(None, "model")), (4, P(None, None))):
        layout = backend.tp_layout(cfg, n)
        loaded = loader.load_weights(
            host,
            cfg,
            weight_dtype="q4_1",
            kv_sharded=layout.kv_sharded,
            vocab_sharded=layout.vocab_sharded,
            tensor_parallel=n,
        )
        lp = partition_specs(loaded).layers[0]
        assert lp.wo.data == wo and lp.w_down.data == P(None, None)
        assert lp.w_gate_up.data == P("model", None, None) and partition_specs(loaded).embed.data == P("model", None)


def test_width_not_a_multiple_of_the_block_is_refused_naming_the_tensor() -> None:
    cfg = dataclasses.replace(
        TINY,
        vocab_size=64,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=24,
        max_position_embeddings=64,
    )

    host = llama.init_params(cfg, jax.random.key(0))
    with pytest.raises(
        ModelDirError, match=r"tensor 'model.layers.0.self_attn.o_proj.weight'.*Q4_1 stores blocks of 32"
    ):
        loader.load_weights(host, cfg, weight_dtype="q4_1")
