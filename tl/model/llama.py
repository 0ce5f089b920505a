"""The Llama-family transformer (Llama, SmolLM2, Mistral, Qwen2) as pure functions over a weight pytree.

Owns: the parameter layout (`param_shapes`, described once; init, HF import and shardings derive
from it), RMSNorm, rotate-half RoPE, GQA projections, the SwiGLU MLP, the paged forward the runner
compiles (layers as `lax.scan` over stacked weights, KV cache in the carry, written in place) and a
dense no-cache forward for embeddings and tests.
Must not: create device arrays outside a traced function (only tl/runner.py places data), know
about buckets, requests or sampling. Attention over the paged cache lives in
kernels/paged_attention.py behind one interface.
Tested by tests/test_llama_reference.py (against an independent numpy forward) and
tests/test_runner.py (paged == dense).

Layout (docs/DESIGN.md): embed [V,D]; layers.{attn_norm [L,D], wq [L,D,Hq*hd], wk/wv [L,D,Hk*hd],
bq/bk/bv [L,*] (Qwen2 only), wo [L,Hq*hd,D], mlp_norm [L,D], w_gate/w_up [L,D,F], w_down [L,F,D]};
final_norm [D]; lm_head [D,V] (absent when tied: embed.T is used).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels.paged_attention import AttnMetadata, paged_attention
from tl.model.config import ModelConfig, ModelDirError

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

    layers = {"attn_norm": s(L, D), "wq": s(L, D, q), "wk": s(L, D, kv), "wv": s(L, D, kv),
              "wo": s(L, q, D), "mlp_norm": s(L, D), "w_gate": s(L, D, F), "w_up": s(L, D, F),
              "w_down": s(L, F, D)}
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
    by_name = {"wq": col, "wk": col, "wv": col, "w_gate": col, "w_up": col, "wo": row, "w_down": row,
               "bq": P(None, "model"), "bk": P(None, "model"), "bv": P(None, "model"),
               "attn_norm": vec, "mlp_norm": vec}
    shapes = param_shapes(cfg)
    specs: Params = {"embed": P("model", None), "final_norm": P(None),
                     "layers": {k: by_name[k] for k in shapes["layers"]}}
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
        x = z[offset:offset + size].reshape(sds.shape)
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


_HF_LAYER = {"attn_norm": ("input_layernorm.weight", False), "wq": ("self_attn.q_proj.weight", True),
             "wk": ("self_attn.k_proj.weight", True), "wv": ("self_attn.v_proj.weight", True),
             "wo": ("self_attn.o_proj.weight", True), "bq": ("self_attn.q_proj.bias", False),
             "bk": ("self_attn.k_proj.bias", False), "bv": ("self_attn.v_proj.bias", False),
             "mlp_norm": ("post_attention_layernorm.weight", False), "w_gate": ("mlp.gate_proj.weight", True),
             "w_up": ("mlp.up_proj.weight", True), "w_down": ("mlp.down_proj.weight", True)}


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
        layers[key] = np.stack([get(f"model.layers.{i}.{hf_name}", sds.shape[1:], transpose)
                                for i in range(cfg.num_hidden_layers)])
    params: Params = {"embed": get("model.embed_tokens.weight", shapes["embed"].shape, False),
                      "layers": layers, "final_norm": get("model.norm.weight", shapes["final_norm"].shape, False)}
    if "lm_head" in shapes:
        params["lm_head"] = get("lm_head.weight", shapes["lm_head"].shape, True)
    return params


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


def mlp(x: jax.Array, lp: Params) -> jax.Array:
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    return (jax.nn.silu(x @ lp["w_gate"]) * (x @ lp["w_up"])) @ lp["w_down"]


def _qkv(h: jax.Array, lp: Params, cfg: ModelConfig,
         rope: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
    T, hd = h.shape[0], cfg.head_dim
    q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
    if cfg.attention_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = apply_rope(q.reshape(T, cfg.num_attention_heads, hd), *rope)
    k = apply_rope(k.reshape(T, cfg.num_key_value_heads, hd), *rope)
    return q, k, v.reshape(T, cfg.num_key_value_heads, hd)


def _layer(x: jax.Array, lp: Params, cfg: ModelConfig, rope: tuple[jax.Array, jax.Array],
           attend: Attend) -> jax.Array:
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    o = attend(*_qkv(h, lp, cfg, rope))
    x = x + o.reshape(x.shape[0], cfg.q_size) @ lp["wo"]
    return x + mlp(rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp)


def lm_logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Final norm then the LM head: hidden [N,D] -> float32 logits [N,V]."""
    h = rms_norm(hidden, params["final_norm"], cfg.rms_norm_eps)
    w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.dot(h, w, preferred_element_type=jnp.float32)


def forward(params: Params, cfg: ModelConfig, token_ids: jax.Array, positions: jax.Array,
            kv: tuple[jax.Array, jax.Array], kv_blocks: jax.Array, kv_offsets: jax.Array,
            meta: AttnMetadata) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Paged forward over a flat token axis.

    token_ids, positions, kv_blocks, kv_offsets: [T] (the cache slot of token t is
    (kv_blocks[t], kv_offsets[t])). kv: (k, v) each [L, num_blocks, block_size, Hk, hd], in the
    scan carry so each layer's new keys are written in place before attention reads them.
    Returns (hidden [T,D] before the final norm, updated kv).
    """
    rope = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
    x = params["embed"][token_ids]

    def body(carry: tuple[jax.Array, jax.Array, jax.Array], xs: tuple[jax.Array, Params]) -> tuple[Any, None]:
        x, k_cache, v_cache = carry
        layer, lp = xs

        def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            nonlocal k_cache, v_cache
            k_cache = k_cache.at[layer, kv_blocks, kv_offsets].set(_to_storage(k, k_cache.dtype))
            v_cache = v_cache.at[layer, kv_blocks, kv_offsets].set(_to_storage(v, v_cache.dtype))
            return paged_attention(q, k, v, k_cache, v_cache, layer, meta)

        x = _layer(x, lp, cfg, rope, attend)
        return (x, k_cache, v_cache), None

    layers = jnp.arange(cfg.num_hidden_layers, dtype=jnp.int32)
    (x, k, v), _ = lax.scan(body, (x, *kv), (layers, params["layers"]))
    return x, (k, v)


def _to_storage(x: jax.Array, storage: Any) -> jax.Array:
    """bf16 KV is stored as uint16 bits: XLA:CPU scatters into a donated bf16 buffer by copying."""
    return lax.bitcast_convert_type(x, storage) if storage == jnp.uint16 else x.astype(storage)


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


def forward_dense(params: Params, cfg: ModelConfig, token_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One sequence at positions 0..T-1, no cache: (final-normed hidden [T,D], logits [T,V])."""
    positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)
    rope = rope_tables(positions, cfg.head_dim, cfg.rope_theta)

    def body(x: jax.Array, lp: Params) -> tuple[jax.Array, None]:
        return _layer(x, lp, cfg, rope, dense_attention), None

    x, _ = lax.scan(body, params["embed"][token_ids], params["layers"])
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), lm_logits(params, cfg, x)


def read_tensors(model_dir: str) -> dict[str, np.ndarray]:
    """HF-named float32 tensors of a model dir (tl/model/files.py; safetensors directly until it lands)."""
    try:
        from tl.model import files
    except ImportError:
        from pathlib import Path

        from safetensors.numpy import load_file

        return load_file(str(Path(model_dir) / "model.safetensors"))
    return files.read_tensors(model_dir)


def load_params(model_dir: str, dtype: str = "float32") -> tuple[Params, ModelConfig]:
    """(host pytree of numpy arrays, ModelConfig) of a Hugging Face model directory."""
    from tl.model.config import load_model_config

    cfg = load_model_config(model_dir)
    return params_from_hf(read_tensors(model_dir), cfg, jnp.dtype(dtype)), cfg
