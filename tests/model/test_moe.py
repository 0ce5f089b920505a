"""Tests of tl/model/moe.py: the mixture-of-experts layer against an independent numpy loop.

- every form ("gather", "tiled", "dense", "ragged") jit-compiled, against a float64 per-token,
  per-chosen-expert loop over the dequantized weights (gguf-py's dequantization for block
  formats), within a bound derived from float32 arithmetic (tests/helpers/bounds.py); the router's
  choices equal the reference's; top_k 1 and 2, 4 and 8 experts, norm_topk_prob on and off;
  float32, int8, q8_0 (quantized at load) and q4_k (the file's packed bytes);
- `choose_form`'s static choice; several tiles per expert in the tiled form;
- loading experts (tl/model/loader.py `WeightLoader.experts`): float, quantized-at-load, packed
  (stacked bytes, not re-encoded), mixed formats (float), the tensor-parallel axes;
- a 2-device `Mesh` (subprocess: the rest of the suite sees one device) equal to one device.
Measured on this CPU (AMD EPYC, 2 cores shared with other jobs: +-30% and worse), min of 15
(5 for the larger) jitted calls, weights on the device, ms; E experts, k per token, D hidden,
Fm expert width, float32 unless named:
  T=1/2/4/8 E=8 k=2 D=Fm=256: gather 0.1/0.1/0.2/0.4, dense 0.1/0.3/0.3/0.4;
  T=1/2/4/8 E=64 k=8 D=512 Fm=256: gather 0.6/4.0/44/86, dense 3.3/17/9.6/10;
  q8_0 T=1 (and 4) E=64 k=8 D=512 Fm=256: gather 1.9 (63), dense 81 (144); int8 T=1: 0.8 vs 94;
  T=64 E=8 k=2 D=Fm=256: ragged 3.7, dense 1.1, tiled 2.3;
  T=256 E=8 k=2 D=Fm=256: ragged 12, dense 2.8, tiled 4.3; E=16: 19, 8.5, 7.4;
  T=1024 E=8 k=2 D=Fm=256: ragged 46, dense 20, tiled 18.5;
  T=256 E=64 k=8 D=512 Fm=256: ragged 1245, dense 129, tiled 280 (q8_0: dense 223, tiled 235);
  T=1024 E=64 k=8 D=512 Fm=256: ragged 3752, dense 922, tiled 448.
ragged_dot on XLA:CPU lowers to a masked product of every pair with every expert (its HLO),
so it is always slower than "dense" there; `choose_form` uses it only off CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest

from bench.kquants import quantize_q4_k
from tests.helpers.bounds import EXP_ERR, U, gamma
from tl.model import moe
from tl.model.config import ModelConfig
from tl.model.files import HostTensor
from tl.model.gguf_model import Packed
from tl.model.loader import WeightLoader
from tl.model.weights import ENCODINGS, Blocks, Dense, Int8, Linear, Tensor

ROOT = Path(__file__).resolve().parents[2]
FORMS: tuple[moe.Form, ...] = ("gather", "tiled", "dense", "ragged")


def _weights(E: int, D: int, Fm: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """router [E, D], gate_up [E, Fm, 2, D], down [E, D, Fm], float32."""
    r = np.random.default_rng(seed)
    router = (r.standard_normal((E, D)) / np.sqrt(D) * 3).astype(np.float32)
    gu = (r.standard_normal((E, Fm, 2, D)) / np.sqrt(D)).astype(np.float32)
    down = (r.standard_normal((E, D, Fm)) / np.sqrt(Fm)).astype(np.float32)
    return router, gu, down


def _dequantized(w: Linear) -> np.ndarray:
    """An encoding's values in float64, independently of tl (gguf-py for blocks)."""
    if isinstance(w, Int8):
        return np.asarray(w.q, np.float64) * np.asarray(w.scale, np.float64)[..., None]
    if isinstance(w, Blocks):
        data = np.asarray(w.data)
        flat = gguf.quants.dequantize(data.reshape(-1, data.shape[-1]), gguf.GGMLQuantizationType[w.fmt.name.upper()])
        return np.asarray(flat, np.float64).reshape(*data.shape[:-1], -1)
    assert isinstance(w, Dense)
    return np.asarray(w.w, np.float64)


def _silu(z: np.ndarray) -> np.ndarray:
    return z / (1 + np.exp(-z))


def reference(x: np.ndarray, e: moe.Experts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(out [T, D] float64, bound [T, D] on |float32 out - out|, ids [T, k]): each token's
    top-k experts by softmax of its router logits, each run as its own SwiGLU, weighted."""
    router = np.asarray(e.router.value, np.float64)
    gu, down = _dequantized(e.w_gate_up), _dequantized(e.w_down)
    E, Fm, _, D = gu.shape
    k = e.top_k
    out, bound, all_ids = np.zeros(x.shape), np.zeros(x.shape), np.zeros((len(x), k), int)
    for t, xt in enumerate(x.astype(np.float64)):
        logits = router @ xt
        p = np.exp(logits - logits.max())
        p /= p.sum()
        ids = np.argsort(-p)[:k]
        w = p[ids] / (p[ids].sum() if e.norm_topk_prob else 1.0)
        # the weights' relative error: logits off by gamma_{D+1} |router| |x|, softmax, renorm
        rho = 4 * gamma(D + 1) * float(np.max(np.abs(router) @ np.abs(xt))) + gamma(2 * E + 2 * k + 8) + 4 * EXP_ERR
        all_ids[t] = ids
        for j, ex in enumerate(ids):
            g, u = gu[ex, :, 0] @ xt, gu[ex, :, 1] @ xt
            eg = gamma(D + 2) * (np.abs(gu[ex, :, 0]) @ np.abs(xt))
            eu = gamma(D + 2) * (np.abs(gu[ex, :, 1]) @ np.abs(xt))
            h = _silu(g) * u
            e_silu = 1.1 * eg + (EXP_ERR + 3 * U) * np.abs(g)
            eh = e_silu * (np.abs(u) + eu) + np.abs(_silu(g)) * eu + U * np.abs(h)
            y = down[ex] @ h
            ey = np.abs(down[ex]) @ eh + gamma(Fm + 2) * (np.abs(down[ex]) @ np.abs(h))
            out[t] += w[j] * y
            bound[t] += w[j] * ey + (rho + gamma(k + 2)) * w[j] * np.abs(y)
    return out, bound, all_ids


def _experts(enc: str, E: int, k: int, norm: bool, D: int, Fm: int, seed: int = 0) -> moe.Experts:
    router, gu, down = _weights(E, D, Fm, seed)
    if enc == "q4_k":  # no quantizer at load: the packed bytes a GGUF would hold
        w_gu: Linear = ENCODINGS["q4_k"](quantize_q4_k(gu).reshape(E, Fm, 2, -1), ())
        w_down: Linear = ENCODINGS["q4_k"](quantize_q4_k(down).reshape(E, D, -1), ())
    else:
        w_gu, w_down = ENCODINGS[enc].encode(gu, ()), ENCODINGS[enc].encode(down, ())
    return moe.Experts(Tensor(router, ()), w_gu, w_down, k, norm)


def _check(e: moe.Experts, T: int, forms: tuple[moe.Form, ...], seed: int = 1) -> None:
    D = e.router.value.shape[1]
    x = np.random.default_rng(seed).standard_normal((T, D)).astype(np.float32)
    want, bound, want_ids = reference(x, e)
    _, ids = jax.jit(moe.route)(x, e)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    for form in forms:
        got = np.asarray(jax.jit(moe.moe_mlp, static_argnames=("act", "form"))(x, e, form=form))
        assert got.dtype == np.float32 and got.shape == (T, D)
        err = np.abs(got - want)
        assert np.all(err <= bound), (form, float(np.max(err - bound)), float(np.max(bound)))


@pytest.mark.parametrize(
    ("E", "k", "norm", "forms"), [(4, 1, False, FORMS), (8, 2, True, FORMS), (8, 2, False, FORMS[:2])]
)
def test_float(E: int, k: int, norm: bool, forms: tuple[moe.Form, ...]) -> None:
    _check(_experts("float32", E, k, norm, D=32, Fm=16), T=12, forms=forms)


@pytest.mark.parametrize(("enc", "forms"), [("int8", ("gather", "tiled")), ("q8_0", ("gather", "dense"))])
def test_quantized(enc: str, forms: tuple[moe.Form, ...]) -> None:
    _check(_experts(enc, 4, 2, True, D=64, Fm=32), T=6, forms=forms)


def test_q4_k_packed() -> None:
    _check(_experts("q4_k", 4, 2, False, D=256, Fm=256), T=5, forms=("gather", "tiled"))


def test_tiled_several_tiles_per_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of 4 rows: an expert's group spans several tiles, the last one padded."""
    monkeypatch.setattr(moe, "TILE_ROWS", 4)
    _check(_experts("float32", 4, 2, True, D=16, Fm=8), T=21, forms=("tiled",))


def test_choose_form() -> None:
    assert moe.choose_form(1, 8, 128, "cpu") == "gather"  # decode: 8 of 128 experts read
    assert moe.choose_form(4, 8, 128, "cpu") == "gather"
    assert moe.choose_form(5, 8, 128, "cpu") == "dense"
    assert moe.choose_form(1024, 8, 128, "cpu") == "tiled"  # 2 * (8192 + 128*127) padded rows <= 131072
    assert moe.choose_form(256, 2, 8, "cpu") == "dense"
    assert moe.choose_form(1024, 2, 8, "cpu") == "tiled"
    assert moe.choose_form(256, 8, 128, "gpu") == "ragged"
    assert moe.choose_form(1, 2, 8, "tpu") == "gather"


def test_bfloat16_activations() -> None:
    """x's dtype in and out; weights cast to it before the sum, as transformers does."""
    e = _experts("float32", 8, 2, True, D=32, Fm=16)
    x = np.random.default_rng(3).standard_normal((3, 32)).astype(np.float32)
    want, _, _ = reference(x, e)
    got = jax.jit(moe.moe_mlp)(jax.numpy.asarray(x, jax.numpy.bfloat16), e)
    assert got.dtype == jax.numpy.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=0.05 * np.abs(want).max())


# ---- loading --------------------------------------------------------------------------------


def _cfg(E: int, k: int, D: int, Fm: int) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "vocab_size": 16,
            "hidden_size": D,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "head_dim": 16,
            "num_experts": E,
            "num_experts_per_tok": k,
            "moe_intermediate_size": Fm,
            "norm_topk_prob": True,
        }
    )


def _hf(E: int, D: int, Fm: int) -> tuple[dict[str, HostTensor], np.ndarray, np.ndarray, np.ndarray]:
    router, gu, down = _weights(E, D, Fm, seed=5)
    p = "model.layers.0.mlp."
    t: dict[str, HostTensor] = {p + "gate.weight": router}
    for ex in range(E):
        x = f"{p}experts.{ex}."
        t |= {
            x + "gate_proj.weight": gu[ex, :, 0],
            x + "up_proj.weight": gu[ex, :, 1],
            x + "down_proj.weight": down[ex],
        }
    return t, router, gu, down


def test_load_float_and_quantized() -> None:
    t, router, gu, down = _hf(4, 64, 32)
    cfg = _cfg(4, 2, 64, 32)
    e = WeightLoader(t, cfg, weight_dtype="auto").experts(0)
    assert isinstance(e.w_gate_up, Dense) and isinstance(e.w_down, Dense)
    np.testing.assert_array_equal(e.w_gate_up.w, gu)
    np.testing.assert_array_equal(e.w_down.w, down)
    np.testing.assert_array_equal(e.router.value, router)
    assert (e.top_k, e.norm_topk_prob, e.num_experts) == (2, True, 4)
    assert e.w_gate_up.axes == ("model", None, None, None) and e.w_down.axes == (None, None, "model")
    q = WeightLoader(t, cfg, weight_dtype="q8_0").experts(0)
    assert type(q.w_gate_up).__name__ == "Q8_0" and q.w_gate_up.out_shape == (4, 32, 2)
    assert q.w_down.axes == (None, None, "model")
    q2 = WeightLoader(t, cfg, weight_dtype="q8_0", tensor_parallel=2).experts(0)
    assert q2.w_down.axes == (None, None, None)  # Fm = 32: one q8_0 block, not split 2 ways
    assert WeightLoader(t, cfg, weight_dtype="auto", tensor_parallel=2).experts(0).w_down.axes[-1] == "model"
    _check(q, T=3, forms=("gather",))


def test_load_packed_keeps_bytes_and_mixed_is_float() -> None:
    E, D, Fm = 4, 256, 256
    t, _, gu, down = _hf(E, D, Fm)
    p = "model.layers.0.mlp.experts."
    packed = dict(t)
    for ex in range(E):
        for name, w in (("gate_proj", gu[ex, :, 0]), ("up_proj", gu[ex, :, 1]), ("down_proj", down[ex])):
            packed[f"{p}{ex}.{name}.weight"] = Packed("q4_k", quantize_q4_k(w).reshape(w.shape[0], -1), w.shape[1])
    e = WeightLoader(packed, _cfg(E, 2, D, Fm), weight_dtype="auto").experts(0)
    assert type(e.w_gate_up).__name__ == "Q4_K" and type(e.w_down).__name__ == "Q4_K"
    gate0 = packed[f"{p}0.gate_proj.weight"]
    up3 = packed[f"{p}3.up_proj.weight"]
    assert isinstance(gate0, Packed) and isinstance(up3, Packed)
    assert e.w_gate_up.data[0, :, 0].tobytes() == gate0.data.tobytes()
    assert e.w_gate_up.data[3, :, 1].tobytes() == up3.data.tobytes()
    _check(e, T=4, forms=("gather",))
    w = down[1]
    packed[f"{p}1.down_proj.weight"] = Packed("q8_0", gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0), Fm)
    mixed = WeightLoader(packed, _cfg(E, 2, D, Fm), weight_dtype="auto").experts(0)
    assert isinstance(mixed.w_down, Dense) and type(mixed.w_gate_up).__name__ == "Q4_K"
    down1 = packed[f"{p}1.down_proj.weight"]
    assert isinstance(down1, Packed)
    np.testing.assert_array_equal(mixed.w_down.w[1], down1.to_float())


# ---- a real mesh ----------------------------------------------------------------------------

_MESH_SCRIPT = """
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tl.model import moe
from tl.model.weights import ENCODINGS, Tensor, partition_specs
assert len(jax.devices()) == 2
r = np.random.default_rng(0)
E, D, Fm = 4, 64, 64
gu = (r.standard_normal((E, Fm, 2, D)) / 8).astype(np.float32)
down = (r.standard_normal((E, D, Fm)) / 8).astype(np.float32)
router = r.standard_normal((E, D)).astype(np.float32)
x = r.standard_normal((6, D)).astype(np.float32)
mesh = Mesh(np.array(jax.devices()), ("model",))
for enc, form in (("float32", "gather"), ("float32", "dense"), ("q8_0", "tiled")):
    e = moe.Experts(Tensor(router, (None, None)), ENCODINGS[enc].encode(gu, ("model", None, None, None)),
                    ENCODINGS[enc].encode(down, (None, None, "model")), 2, True)
    specs = partition_specs(e)
    placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), e, specs,
                          is_leaf=lambda v: isinstance(v, P))
    assert placed.w_gate_up.axes == ("model", None, None, None)
    f = jax.jit(moe.moe_mlp, static_argnames=("act", "form"))
    one = np.asarray(f(x, e, form=form))
    two = f(x, placed, form=form)
    assert len(two.sharding.device_set) == 2
    np.testing.assert_allclose(np.asarray(two), one, rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_two_device_mesh() -> None:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", _MESH_SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-3000:]
