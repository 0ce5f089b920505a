"""The Llama-family transformer (Llama, SmolLM2, Mistral, Qwen2) as pure functions over a weight pytree.

Owns: the parameter layout (`param_shapes`, described once; init, HF import and shardings derive
from it), RMSNorm, rotate-half RoPE, GQA projections, the SwiGLU MLP, the paged forward the runner
compiles (layers unrolled over per-layer weights, KV cache written in place) and a
dense no-cache forward for embeddings and tests.
Must not: create device arrays outside a traced function (only tl/runner.py places data), know
about buckets, requests or sampling. Attention over the paged cache lives in
kernels/paged_attention.py behind one interface.
Tested by tests/test_llama_reference.py (against an independent numpy forward) and
tests/test_runner.py (paged == dense).

Layout (docs/DESIGN.md): embed [V,D]; layers.{attn_norm [L,D], wq [L,D,Hq*hd], wk/wv [L,D,Hk*hd],
bq/bk/bv [L,*] (Qwen2 only), wo [L,Hq*hd,D], mlp_norm [L,D], w_gate/w_up [L,D,F], w_down [L,F,D]};
final_norm [D]; lm_head [D,V] (absent when tied: embed.T is used).

The runner compiles over a second, derived layout (`step_params`): a Python list of per-layer
dicts {attn_norm, wqkv [Hk,G+2,hd,D], bqkv? [Hk,G+2,hd], wo [D,Hq*hd], mlp_norm, w_gate_up
[F,2,D], w_down [D,F]} (G = Hq/Hk), and lm_head [V,D]: every matrix [*out, in], as PyTorch
stores them (`linear` says why), the axis tensor parallelism splits first among the out axes
(so that `linear` can flatten them into one without resharding).
Why per-layer dicts: inside a `lax.scan` XLA:CPU materialises each layer's dynamic slice of the
stacked weights before the dot (a copy of every weight, every step: batch-1 decode ran at half
speed), and one fused QKV and one gate-up matmul use the cores better than three and two.
The fused weights keep an axis that tensor parallelism can split (Megatron layout, tl/backend.py):
wqkv is grouped by KV head (group g: its G query heads, then k head g, then v head g), so a split
of the Hk axis over N devices hands each device whole groups, i.e. exactly its q, k and v heads,
for every N dividing Hk; w_gate_up is [F,2,D] split on F, so each device holds matching gate and
up rows. (Plain [q|k|v] or [gate|up] rows split N ways would give device 0 only query heads
or only gate rows.) In memory [F,2,D] interleaves gate and up rows; the MLP takes every other
output column.
When N does not divide Hk the KV heads are replicated and q cannot share a matrix with them: the
layers then hold wq [Hq*hd,D] (split by output) and wk/wv [Hk*hd,D] (+ bq/bk/bv), see `fuse_qkv`.
With weight_dtype "int8" every linear (and the embedding / tied head) is {"q": int8 [*out,in],
"scale": f32 [*out]} per output channel (scales follow their columns, and their shards), used by
`linear` as an int8 x int8 -> int32 dot on activations quantized per row (XLA:CPU's int8 -> f32
convert runs ~10x slower than the f32 dot it would feed; its integer dot is fast).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels.paged_attention import AttnMetadata, paged_attention, write_kv
from tl.model.config import ModelConfig, ModelDirError
from tl.model.files import read_tensors

Params = dict[str, Any]
"""The weight pytree: nested dicts of arrays, keys as in the module docstring."""
Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
"""(q [T,Hq,hd], k [T,Hk,hd], v [T,Hk,hd]) -> [T,Hq,hd] for one layer."""


def param_shapes(cfg: ModelConfig, dtype: Any = jnp.float32) -> Params:
    """The weight pytree as ShapeDtypeStructs: the single description of the layout."""
    L, D, F, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.q_size, cfg.kv_size

    def s(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype)

    layers = {
        "attn_norm": s(L, D),
        "wq": s(L, D, q),
        "wk": s(L, D, kv),
        "wv": s(L, D, kv),
        "wo": s(L, q, D),
        "mlp_norm": s(L, D),
        "w_gate": s(L, D, F),
        "w_up": s(L, D, F),
        "w_down": s(L, F, D),
    }
    if cfg.attention_bias:
        layers |= {"bq": s(L, q), "bk": s(L, kv), "bv": s(L, kv)}
    params: Params = {"embed": s(V, D), "layers": layers, "final_norm": s(D)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = s(D, V)
    return params


def param_partition_specs(cfg: ModelConfig) -> Params:
    """PartitionSpecs over mesh axes ("data", "model"): Megatron-style tensor parallelism.

    Column-parallel q/k/v/gate/up (shard the output features), row-parallel o/down (shard the
    input features), vocab-parallel embed and lm_head. With a 1-wide "model" axis this is
    replication; a wider axis changes the mesh, not this layout.
    """
    from jax.sharding import PartitionSpec as P

    col, row, vec = P(None, None, "model"), P(None, "model", None), P(None, None)
    by_name = {
        "wq": col,
        "wk": col,
        "wv": col,
        "w_gate": col,
        "w_up": col,
        "wo": row,
        "w_down": row,
        "bq": P(None, "model"),
        "bk": P(None, "model"),
        "bv": P(None, "model"),
        "attn_norm": vec,
        "mlp_norm": vec,
    }
    shapes = param_shapes(cfg)
    specs: Params = {
        "embed": P("model", None),
        "final_norm": P(None),
        "layers": {k: by_name[k] for k in shapes["layers"]},
    }
    if "lm_head" in shapes:
        specs["lm_head"] = P(None, "model")
    return specs


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random weights for tests: norms near 1, matrices scaled by 1/sqrt(fan_in). One compile."""
    return _init_params(cfg, key, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_params(cfg: ModelConfig, key: jax.Array, dtype: Any) -> Params:
    shapes = param_shapes(cfg, dtype)
    leaves, treedef = jax.tree.flatten_with_path(shapes)
    sizes = [int(np.prod(sds.shape)) for _, sds in leaves]
    z = jax.random.normal(key, (sum(sizes),))  # one draw for all leaves: one RNG in the program
    out, offset = [], 0
    for (path, sds), size in zip(leaves, sizes, strict=True):
        x = z[offset : offset + size].reshape(sds.shape)
        offset += size
        name = str(path[-1].key)
        if name.endswith("norm"):
            x = 1.0 + 0.1 * x
        elif name.startswith("b"):
            x = 0.1 * x
        else:
            x = x / np.sqrt(sds.shape[-1] if name == "embed" else sds.shape[-2])
        out.append(x.astype(dtype))
    return jax.tree.unflatten(treedef, out)


_HF_LAYER = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}


def params_from_hf(tensors: Mapping[str, np.ndarray], cfg: ModelConfig, dtype: Any = np.float32) -> Params:
    """Hugging Face tensors ([out,in] linears) -> host pytree of stacked [in,out] numpy arrays."""
    shapes = param_shapes(cfg, dtype)

    def get(name: str, shape: tuple[int, ...], transpose: bool) -> np.ndarray:
        if name not in tensors:
            raise ModelDirError(f"weights: missing tensor {name!r}")
        x = np.asarray(tensors[name])
        x = x.T if transpose else x
        if x.shape != shape:
            raise ModelDirError(f"weights: tensor {name!r} has shape {x.shape}, expected {shape}")
        return x.astype(dtype)

    layers = {}
    for key, sds in shapes["layers"].items():
        hf_name, transpose = _HF_LAYER[key]
        layers[key] = np.stack(
            [get(f"model.layers.{i}.{hf_name}", sds.shape[1:], transpose) for i in range(cfg.num_hidden_layers)]
        )
    params: Params = {
        "embed": get("model.embed_tokens.weight", shapes["embed"].shape, False),
        "layers": layers,
        "final_norm": get("model.norm.weight", shapes["final_norm"].shape, False),
    }
    if "lm_head" in shapes:
        params["lm_head"] = get("lm_head.weight", shapes["lm_head"].shape, True)
    return params


WeightDType = str
""""float32" (weights as stored) or "int8" (per-output-channel symmetric quantization)."""
# XLA:CPU's int8 dot takes a matrix-vector path at 1 row, 9x slower (the 30 SmolLM2 layers'
# matmuls: 113 vs 12.7 ms); 2 and 3 rows ran as fast unpadded as padded, and 1 row padded to 2
# as fast as to 4 (re-measured, alternated in one process). Only one-row steps without the
# native kernel (kernels/cpu_native.py) reach this padding.
_INT8_MIN_ROWS = 4


def quantize_int8(w_out_in: np.ndarray) -> dict[str, np.ndarray]:
    """[out,in] float -> {"q": int8 [out,in], "scale": f32 [out]}: w ~= q * scale[:, None]."""
    w = np.asarray(w_out_in, np.float32)
    scale = np.maximum(np.abs(w).max(axis=1), 1e-12) / 127.0
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return {"q": q, "scale": scale.astype(np.float32)}


def fuse_qkv(wq: Any, wk: Any, wv: Any, cfg: ModelConfig) -> Any:
    """[..., Hq*hd], [..., Hk*hd] x2 -> [..., Hk, G+2, hd] grouped by KV head (numpy or jax).

    Group g is [query heads g*G .. g*G+G-1 | k head g | v head g] (query head h reads KV head
    h // G, as in the attention kernels): the Hk axis is what tensor parallelism splits.
    """
    xp = np if isinstance(wq, np.ndarray) else jnp
    lead, hk, hd = wq.shape[:-1], cfg.num_key_value_heads, cfg.head_dim
    return xp.concatenate(
        [wq.reshape(*lead, hk, -1, hd), wk.reshape(*lead, hk, 1, hd), wv.reshape(*lead, hk, 1, hd)], axis=-2
    )


def fuse_gate_up(w_gate: Any, w_up: Any) -> Any:
    """[..., F] x2 -> [..., F, 2] (numpy or jax): split on F, each device keeps gate and up columns."""
    xp = np if isinstance(w_gate, np.ndarray) else jnp
    return xp.stack([w_gate, w_up], axis=-1)


def step_params(
    params: Params,
    cfg: ModelConfig,
    weight_dtype: WeightDType = "float32",
    fused_qkv: bool = True,
    pack: Callable[[np.ndarray], np.ndarray] | None = None,
) -> Params:
    """Canonical stacked host params -> the per-layer, fused layout `forward` runs on (host numpy).

    fused_qkv=False keeps wq/wk/wv apart: for tensor parallelism with replicated KV heads.
    pack (float32 weights; kernels/cpu_native.pack_bf16x3 for matmul_precision "high"): each
    linear becomes {"f32": w [*out, in], "bf16x3": pack(w)}, and the LM head's packing is
    "lm_head_bf16x3" (beside embed or lm_head, which stay float32 for lookups and few rows).
    """
    if weight_dtype not in ("float32", "int8"):
        raise ValueError(f"weight_dtype must be float32 or int8, got {weight_dtype!r}")
    int8 = weight_dtype == "int8"

    if int8 and pack is not None:
        raise ValueError("int8 weights have no bf16x3 packing")

    def lin(w_in_out: np.ndarray) -> Any:  # [in, *out] -> [*out, in] (float) or int8 {q [*out, in], scale [*out]}
        w = np.asarray(w_in_out)
        if not int8:
            w = np.ascontiguousarray(np.moveaxis(w, 0, -1))
            return w if pack is None else {"f32": w, "bf16x3": pack(w)}
        qw = quantize_int8(w.reshape(w.shape[0], -1).T)
        return {"q": qw["q"].reshape(*w.shape[1:], w.shape[0]), "scale": qw["scale"].reshape(w.shape[1:])}

    ly = params["layers"]
    layers = []
    for i in range(cfg.num_hidden_layers):
        lp = {
            "attn_norm": np.asarray(ly["attn_norm"][i]),
            "wo": lin(ly["wo"][i]),
            "mlp_norm": np.asarray(ly["mlp_norm"][i]),
            "w_gate_up": lin(fuse_gate_up(np.asarray(ly["w_gate"][i]), np.asarray(ly["w_up"][i]))),
            "w_down": lin(ly["w_down"][i]),
        }
        if fused_qkv:
            wq, wk, wv = (np.asarray(ly[n][i]) for n in ("wq", "wk", "wv"))
            lp["wqkv"] = lin(fuse_qkv(wq, wk, wv, cfg))
            if cfg.attention_bias:
                bq, bk, bv = (np.asarray(ly[n][i]) for n in ("bq", "bk", "bv"))
                lp["bqkv"] = fuse_qkv(bq, bk, bv, cfg)
        else:
            lp |= {n: lin(ly[n][i]) for n in ("wq", "wk", "wv")}
            if cfg.attention_bias:
                lp |= {n: np.asarray(ly[n][i]) for n in ("bq", "bk", "bv")}
        layers.append(lp)
    embed = quantize_int8(params["embed"]) if int8 else np.asarray(params["embed"])
    out: Params = {"embed": embed, "layers": layers, "final_norm": np.asarray(params["final_norm"])}
    if "lm_head" in params:
        head = np.asarray(params["lm_head"]).T  # [V, D], as every step-layout matrix: [out, in]
        out["lm_head"] = quantize_int8(head) if int8 else np.ascontiguousarray(head)
    if pack is not None:
        out["lm_head_bf16x3"] = pack(out["lm_head"] if "lm_head" in out else embed)
    return out


Matmul = Callable[[jax.Array, Any], "jax.Array | None"]
"""(x [N,in], w as `linear` takes it) -> [N,*out], or None where it does not apply: a backend's
matmul (kernels/select.py; the native CPU kernels for few rows)."""


def linear(x: jax.Array, w: Any, matmul: Matmul | None = None) -> jax.Array:
    """x [N,in] times w -> [N,*out]: a float [*out,in] array, or int8 {"q" [*out,in], "scale" [*out]}
    (W8A8, f32 out). The out axes stay apart so that their sharding (tl/backend.py) carries over.
    matmul, if given, goes first; where it returns None XLA's dot does the work.
    Why [*out,in] (PyTorch's layout): XLA:CPU's dot transposed an [in,out] weight on every call
    (ynn::transpose, 11% of a 64-sequence decode step); contracting the last axes, the 30 layers'
    matmuls alone ran 1.25-1.39x faster at 32-128 rows and 1.1x at 512, a whole 64-sequence
    decode step 1.05x (both layouts alternated in one process)."""
    if matmul is not None and (y := matmul(x, w)) is not None:
        return y.astype(x.dtype)
    if isinstance(w, dict) and "f32" in w:  # "high" precision weights where no native kernel ran
        w = w["f32"]
    if not isinstance(w, dict):  # out axes flattened: XLA:CPU's dot ran 2.5x slower on [2,F,D] than [2F,D]
        y = lax.dot_general(x, w.reshape(-1, w.shape[-1]), (((1,), (1,)), ((), ())))
        return y.reshape(x.shape[0], *w.shape[:-1])
    n, q = x.shape[0], w["q"]
    xf = jnp.pad(x.astype(jnp.float32), ((0, max(0, _INT8_MIN_ROWS - n)), (0, 0)))
    x_scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=1, keepdims=True), 1e-12) / 127.0
    xq = jnp.round(xf / x_scale).astype(jnp.int8)
    # q as the left operand ([*out, in] is then the dot's natural [M, K]): with q on the right,
    # XLA:CPU copied every int8 weight into [in, out] every step (44 of 61 ms at 4 rows).
    acc = lax.dot_general(q.reshape(-1, q.shape[-1]), xq, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    acc = acc.T.reshape(xq.shape[0], *q.shape[:-1])
    row_scale = x_scale[:n].reshape((n,) + (1,) * (q.ndim - 1))
    return (acc[:n].astype(jnp.float32) * row_scale * w["scale"]).astype(x.dtype)


def embed_lookup(embed: Any, token_ids: jax.Array) -> jax.Array:
    """Rows of the embedding (float [V,D], or int8 rows times their per-row scale)."""
    if not isinstance(embed, dict):
        return embed[token_ids]
    return embed["q"][token_ids].astype(jnp.float32) * embed["scale"][token_ids][:, None]


def _unstacked(params: Params, cfg: ModelConfig) -> list[Params]:
    """Per-layer dicts in the step layout from either layout (canonical: fused and transposed
    to [*out, in] on the fly)."""
    ly = params["layers"]
    if isinstance(ly, list):
        return ly
    out = []

    def t(w: jax.Array) -> jax.Array:
        return jnp.moveaxis(w, 0, -1)

    for i in range(ly["wq"].shape[0]):
        lp = {
            "attn_norm": ly["attn_norm"][i],
            "wo": t(ly["wo"][i]),
            "mlp_norm": ly["mlp_norm"][i],
            "wqkv": t(fuse_qkv(ly["wq"][i], ly["wk"][i], ly["wv"][i], cfg)),
            "w_gate_up": t(fuse_gate_up(ly["w_gate"][i], ly["w_up"][i])),
            "w_down": t(ly["w_down"][i]),
        }
        if "bq" in ly:
            lp["bqkv"] = fuse_qkv(ly["bq"][i], ly["bk"][i], ly["bv"][i], cfg)
        out.append(lp)
    return out


def step_partition_specs(step: Params, replicated: frozenset[str] = frozenset()) -> Params:
    """PartitionSpecs of `step_params` output over mesh axes ("data", "model"): Megatron layout.

    Column-parallel wqkv (by KV-head group), wq/wk/wv, w_gate_up (by F) and their biases;
    row-parallel wo/w_down (XLA all-reduces after them); embed and lm_head by vocab; norms
    replicated. `by_name` gives each matrix's axes as [in, *out]; stored ([*out, in], float
    or int8 "q"; "scale" [*out]) they are rotated to match (embed is [V,D] as stored).
    Leaves named in `replicated` (tl/backend.py: KV weights when
    KV heads do not divide, embed/lm_head when the vocab does not) are whole on every device.
    """
    from jax.sharding import PartitionSpec as P

    col = ("wq", "wk", "wv", "bq", "bk", "bv")
    by_name = {
        "wqkv": (None, "model", None, None),
        "bqkv": ("model", None, None),
        "w_gate_up": (None, "model", None),
        "wo": ("model", None),
        "w_down": ("model", None),
        "embed": ("model", None),
        "lm_head": (None, "model"),
        **{n: (None, "model") if n.startswith("w") else ("model",) for n in col},
    }

    def spec(path: Any, _: Any) -> P:
        keys = [str(getattr(k, "key", "")) for k in path]
        int8_part = keys[-1] if keys[-1] in ("q", "scale") and len(keys) > 1 and keys[-2] in by_name else ""
        name = keys[-2] if int8_part else keys[-1]
        if name not in by_name or name in replicated:
            return P()
        axes = by_name[name]
        if name == "embed":  # stored [V,D] in both forms
            return P(*axes) if int8_part != "scale" else P(axes[0])
        if name.startswith("b"):  # biases: [*out]
            return P(*axes)
        out_axes = axes[1:]  # the [in,*out] matrix's out axes
        return P(*out_axes) if int8_part == "scale" else P(*out_axes, axes[0])

    return jax.tree_util.tree_map_with_path(spec, step)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, cast back to x's dtype (as Hugging Face does)."""
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf.astype(x.dtype) * w).astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin [T, hd] for rotate-half RoPE; computed once per step, shared by all layers."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T,H,hd] rotated by position (rotate-half pairing: i with i + hd/2)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x.astype(jnp.float32) * cos[:, None, :] + rotated.astype(jnp.float32) * sin[:, None, :]
    return out.astype(x.dtype)


def mlp(x: jax.Array, lp: Params, matmul: Matmul | None = None) -> jax.Array:
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up as one [F,2,D] matmul."""
    gu = linear(x, lp["w_gate_up"], matmul)  # [T, F, 2]
    return linear(jax.nn.silu(gu[..., 0]) * gu[..., 1], lp["w_down"], matmul)


def _qkv(
    h: jax.Array, lp: Params, cfg: ModelConfig, rope: tuple[jax.Array, jax.Array], matmul: Matmul | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    T, hd, hq, hk = h.shape[0], cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    if "wqkv" in lp:  # [D, Hk, G+2, hd]: per KV head, its G query heads, its k, its v
        qkv = linear(h, lp["wqkv"], matmul)
        if cfg.attention_bias:
            qkv = qkv + lp["bqkv"]
        g = hq // hk
        q, k, v = qkv[:, :, :g].reshape(T, hq, hd), qkv[:, :, g], qkv[:, :, g + 1]
    else:  # tensor parallel with replicated KV heads: q split by head, k/v whole on each device
        q, k, v = linear(h, lp["wq"], matmul), linear(h, lp["wk"], matmul), linear(h, lp["wv"], matmul)
        if cfg.attention_bias:
            q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
        q, k, v = q.reshape(T, hq, hd), k.reshape(T, hk, hd), v.reshape(T, hk, hd)
    return apply_rope(q, *rope), apply_rope(k, *rope), v


def _layer(
    x: jax.Array,
    lp: Params,
    cfg: ModelConfig,
    rope: tuple[jax.Array, jax.Array],
    attend: Attend,
    matmul: Matmul | None = None,
) -> jax.Array:
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    o = attend(*_qkv(h, lp, cfg, rope, matmul))
    x = x + linear(o.reshape(x.shape[0], cfg.q_size), lp["wo"], matmul)
    return x + mlp(rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp, matmul)


def lm_logits(params: Params, cfg: ModelConfig, hidden: jax.Array, matmul: Matmul | None = None) -> jax.Array:
    """Final norm then the LM head: hidden [N,D] -> float32 logits [N,V]; `matmul` first, as in
    `linear` (the native few-row kernel ran a whole decode step 1.04x faster at 1 row, 1.11x at
    4 and 1.06x at 16 than XLA's dot here, alternated in one process)."""
    h = rms_norm(hidden, params["final_norm"], cfg.rms_norm_eps)
    w = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    if isinstance(w, dict):  # int8 [V,D]: already [out,in]
        return linear(h, w, matmul).astype(jnp.float32)
    if not cfg.tie_word_embeddings and not isinstance(params["layers"], list):
        w = w.T  # the canonical layout's lm_head is [D,V]; the step layout's [V,D]
    if "lm_head_bf16x3" in params:  # matmul_precision "high": as the layers' linears
        return linear(h, {"f32": w, "bf16x3": params["lm_head_bf16x3"]}, matmul).astype(jnp.float32)
    if matmul is not None and (y := matmul(h, w)) is not None:
        return y.astype(jnp.float32)
    # Contract with [V,D] directly: `h @ embed.T` copied 113 MB a step.
    return lax.dot_general(h, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def forward(
    params: Params,
    cfg: ModelConfig,
    token_ids: jax.Array,
    positions: jax.Array,
    kv: tuple[jax.Array, jax.Array],
    kv_blocks: jax.Array,
    kv_offsets: jax.Array,
    meta: AttnMetadata,
    attention: Callable[..., jax.Array] = paged_attention,
    matmul: Matmul | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Paged forward over a flat token axis.

    token_ids, positions, kv_blocks, kv_offsets: [T] (the cache slot of token t is
    (kv_blocks[t], kv_offsets[t])). kv: (k, v) in kernels/paged_attention.py's stored layout; each
    layer's new keys are written in place (donated buffers) before its attention reads them.
    params: the `step_params` layout (the canonical stacked one also works, slowly: for tests).
    attention: kernels.paged_attention.paged_attention's interface (kernels/select.py picks one);
    matmul: the float layer matmuls' implementation (None: XLA's dot; kernels/select.py).
    Returns (hidden [T,D] before the final norm, updated kv).
    """
    rope = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
    x = embed_lookup(params["embed"], token_ids).astype(_act_dtype(params))
    k_cache, v_cache = kv
    for layer, lp in enumerate(_unstacked(params, cfg)):  # unrolled: see the module docstring

        def attend(q: jax.Array, k: jax.Array, v: jax.Array, layer: int = layer) -> jax.Array:
            nonlocal k_cache, v_cache
            k_cache = write_kv(k_cache, "k", layer, kv_blocks, kv_offsets, _to_storage(k, k_cache.dtype))
            v_cache = write_kv(v_cache, "v", layer, kv_blocks, kv_offsets, _to_storage(v, v_cache.dtype))
            return attention(q, k, v, k_cache, v_cache, jnp.int32(layer), meta)

        x = _layer(x, lp, cfg, rope, attend, matmul)
    return x, (k_cache, v_cache)


def _act_dtype(params: Params) -> Any:
    """Activation dtype: the norms' dtype (int8 weights keep float norms)."""
    return params["final_norm"].dtype


def _to_storage(x: jax.Array, storage: Any) -> jax.Array:
    """bf16 KV is stored as uint16 bits (x rounded to bf16 first): XLA:CPU scatters into a donated
    bf16 buffer by copying."""
    if storage == jnp.uint16:
        return lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(storage)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal GQA attention of one sequence: q [T,Hq,hd], k/v [T,Hk,hd] -> [T,Hq,hd]."""
    T, Hq, hd = q.shape
    G = Hq // k.shape[1]
    qg = q.reshape(T, k.shape[1], G, hd).astype(jnp.float32)
    s = jnp.einsum("tkgd,skd->kgts", qg, k.astype(jnp.float32)) / np.sqrt(hd)
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))
    p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
    o = jnp.einsum("kgts,skd->tkgd", p, v.astype(jnp.float32))
    return o.reshape(T, Hq, hd).astype(q.dtype)


def forward_dense(
    params: Params, cfg: ModelConfig, token_ids: jax.Array, matmul: Matmul | None = None
) -> tuple[jax.Array, jax.Array]:
    """One sequence at positions 0..T-1, no cache: (final-normed hidden [T,D], logits [T,V]);
    `matmul` as in `linear` (a runner's, to compare its matmuls on one path)."""
    positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)
    rope = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
    x = embed_lookup(params["embed"], token_ids).astype(_act_dtype(params))
    for lp in _unstacked(params, cfg):
        x = _layer(x, lp, cfg, rope, dense_attention, matmul)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), lm_logits(params, cfg, x, matmul)


def load_params(model_dir: str, dtype: str = "float32") -> tuple[Params, ModelConfig]:
    """(host pytree of numpy arrays, ModelConfig) of a Hugging Face model directory."""
    from tl.model.config import load_model_config

    cfg = load_model_config(model_dir)
    return params_from_hf(read_tensors(model_dir), cfg, jnp.dtype(dtype)), cfg
