"""The decoder-only transformer of every family tl serves, as pure functions over typed weights.

Families (tl/model/config.py turns each config.json into flags of one ModelConfig): Llama 1-3
and SmolLM2 (Llama 3's "llama3" RoPE scaling), Mistral (sliding window), Qwen2 (q/k/v biases),
Qwen3 (per-head q/k RMSNorm), Qwen3-MoE (tl/model/moe.py's experts in place of the MLP) and
Gemma 3 ((1 + w) norms, four per layer, embeddings scaled by sqrt(D), tanh-GELU GeGLU,
query_pre_attn_scalar, sliding layers with their own RoPE base). Checked against transformers'
logits for a tiny model of each (tests/model/test_families.py).
Owns: the model's parameters, described once (`Weights`, `Layer`: flax.struct dataclasses of the
tl/model/weights.py types, each parameter built by tl/model/loader.py's `WeightLoader` with its
encoding and its tensor-parallel axes), random weights for tests (`init_params`: Hugging Face
tensors), RMSNorm, rotate-half RoPE (scaled, per layer),
GQA projections, the gated MLP, the paged forward the runner compiles (layers unrolled, KV cache
written in place, each layer's attention window in its metadata) and a dense no-cache forward
for embeddings and tests.
Must not: load weights (tl/model/loader.py does), create device arrays outside a traced function
(tl/runtime/placement.py places data), know about buckets, requests or sampling. Attention over the paged cache lives in
kernels/paged_attention.py behind one interface.
Tested by tests/model/test_llama_reference.py (against an independent numpy forward over the same
Hugging Face tensors) and tests/runtime/test_runner.py (paged == dense).

Layout (docs/internals.md): `Weights` = embed [V,D] (a linear: the tied LM head contracts with it),
layers: a tuple of `Layer` {attn_norm [D], wqkv [Hk,G+2,hd,D], bqkv? [Hk,G+2,hd] (Qwen2),
wo [D,Hq*hd], mlp_norm [D], w_gate_up [F,2,D], w_down [D,F]} (G = Hq/Hk), final_norm [D],
lm_head [V,D] (None when tied), head_packed (matmul_precision "high": the LM head's bf16x3
packing). Every matrix is [*out, in], as Hugging Face stores them (so loading transposes
nothing; `Dense` says why), the axis tensor parallelism splits first among the out axes.
Why per-layer structs: inside a `lax.scan` XLA:CPU materialises each layer's dynamic slice of
stacked weights before the dot (a copy of every weight, every step: batch-1 decode ran at half
speed), and one fused QKV and one gate-up matmul use the cores better than three and two.
The fused weights keep an axis that tensor parallelism can split (Megatron layout): wqkv is
grouped by KV head (group g: its G query heads, then k head g, then v head g), so a split of
the Hk axis over N devices hands each device whole groups, i.e. exactly its q, k and v heads,
for every N dividing Hk; w_gate_up is [F,2,D] split on F, so each device holds matching gate
and up rows. (Plain [q|k|v] or [gate|up] rows split N ways would give device 0 only query
heads or only gate rows.) In memory [F,2,D] interleaves gate and up rows; the MLP takes every
other output column.
When N does not divide Hk the KV heads are replicated and q cannot share a matrix with them: the
layers then hold wq [Hq*hd,D] (split by output) and wk/wv [Hk*hd,D] whole (+ bq/bk/bv).
Column-parallel wqkv/wq/w_gate_up and their biases, row-parallel wo/w_down (XLA all-reduces
after them), embed and lm_head by vocab (whole when N does not divide V), norms whole.
With weight_dtype "int8" every linear (and the embedding / tied head) is `Int8` per output
channel (scales follow their rows, and their shards); with "q8_0" it is `Q8_0`, a float16 scale
per block of 32 inputs (scales follow their rows; a row-parallel weight is split by input only
where each device gets whole blocks, else kept whole on every device).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels.paged_attention import AttnArgs, AttnMetadata, PagedAttention, paged_attention, write_kv
from tl.model import rowwise, tree
from tl.model.config import ModelConfig, RopeScaling, hf_shapes
from tl.model.moe import Experts, moe_mlp
from tl.model.weights import Bf16x3, Dense, Linear, Table, Tensor

Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
"""(q [T,Hq,hd], k [T,Hk,hd], v [T,Hk,hd]) -> [T,Hq,hd] for one layer."""
Matmul = Callable[[jax.Array, Any], "jax.Array | None"]
"""(x [N,in], a weights.Linear) -> [N,*out], or None where it does not apply: a backend's matmul
(kernels/select.py; the native CPU kernels for few rows)."""


@tree.dataclass
class Layer:
    attn_norm: Tensor
    wo: Linear
    mlp_norm: Tensor
    w_down: Linear | None = None  # None in a mixture-of-experts layer (`moe`)
    w_gate_up: Linear | None = None  # [F,2,D] fused (gate and up in one encoding)
    w_gate: Linear | None = None  # apart (a GGUF storing gate and up in different formats)
    w_up: Linear | None = None
    wqkv: Linear | None = None  # fused (KV heads sharded or one device)
    bqkv: Tensor | None = None
    wq: Linear | None = None  # unfused (tensor parallel with replicated KV heads)
    wk: Linear | None = None
    wv: Linear | None = None
    bq: Tensor | None = None
    bk: Tensor | None = None
    bv: Tensor | None = None
    q_norm: Tensor | None = None  # [hd]: RMSNorm of each query head before RoPE (Qwen3, Gemma 3)
    k_norm: Tensor | None = None
    attn_post_norm: Tensor | None = None  # [D]: on the attention's output (Gemma's sandwich norms)
    mlp_post_norm: Tensor | None = None  # [D]: on the MLP's output
    moe: Experts | None = None  # a mixture-of-experts layer in place of the MLP


@tree.dataclass
class Weights:
    embed: Table  # [V, D]
    layers: tuple[Layer, ...]
    final_norm: Tensor
    lm_head: Table | None = None  # [V, D]; None when tied to embed
    head_packed: Tensor | None = None  # bf16x3 packing of the LM head (matmul_precision "high")

    def head(self) -> Linear:
        """The LM head as `linear` takes it: lm_head or the tied embedding, with its packing."""
        w = self.embed if self.lm_head is None else self.lm_head
        if self.head_packed is not None and isinstance(w, Dense):
            return Bf16x3.of(w, self.head_packed.value)
        return w

    @property
    def act_dtype(self) -> Any:
        """Activation dtype: the norms' dtype (int8 weights keep float norms)."""
        return self.final_norm.value.dtype


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.float32) -> dict[str, np.ndarray]:
    """Random Hugging Face tensors for tests (numpy): norms near 1, biases near 0, matrices
    scaled by 1/sqrt(fan_in). One compile, one draw."""
    shapes = hf_shapes(cfg)
    flat = np.asarray(_normal(key, sum(int(np.prod(s)) for s in shapes.values())))
    out, offset = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape))
        x = flat[offset : offset + size].reshape(shape)
        offset += size
        if "norm" in name:
            x = 1.0 + 0.1 * x
        elif name.endswith("bias"):
            x = 0.1 * x
        else:
            x = x / np.sqrt(shape[-1])
        out[name] = np.asarray(x.astype(jnp.dtype(dtype)))
    return out


@functools.partial(jax.jit, static_argnums=1)
def _normal(key: jax.Array, n: int) -> jax.Array:
    return jax.random.normal(key, (n,))


def linear(x: jax.Array, w: Linear, matmul: Matmul | None = None) -> jax.Array:
    """x [N,in] times w [*out,in] -> [N,*out] in x's dtype. The out axes stay apart so that their
    sharding carries over. matmul, if given, goes first; where it returns None, the weight's own
    `dot` (XLA's arithmetic for its encoding) does the work.
    Why [*out,in] (PyTorch's layout): XLA:CPU's dot transposed an [in,out] weight on every call
    (ynn::transpose, 11% of a 64-sequence decode step); contracting the last axes, the 30 layers'
    matmuls alone ran 1.25-1.39x faster at 32-128 rows and 1.1x at 512, a whole 64-sequence
    decode step 1.05x (both layouts alternated in one process)."""
    if matmul is not None and (y := matmul(x, w)) is not None:
        return y.astype(x.dtype)
    return w.dot(x).astype(x.dtype)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, cast back to x's dtype (as Hugging Face does)."""
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(rowwise.row_mean(xf * xf, keepdims=True) + eps)
    return (xf.astype(x.dtype) * w).astype(x.dtype)


Rope = tuple[jax.Array, jax.Array]
"""cos, sin [T, hd] of one RoPE base and scaling at the step's positions."""


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """RoPE's inverse frequencies [hd/2] (float32, computed under the trace as tl always has:
    SmolLM2's golden answers depend on these roundings), scaled: "linear" divides all by factor;
    "llama3" (Llama 3.1) divides the long wavelengths (beyond original_max_position_embeddings /
    low_freq_factor) by factor, keeps the short ones (below .. / high_freq_factor) and blends
    linearly in wavelength-inverse between."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv
    factor = jnp.asarray(scaling.factor, jnp.float32)
    if scaling.rope_type == "linear":
        return inv / factor
    old = jnp.float32(scaling.original_max_position_embeddings)
    lo, hi = jnp.float32(scaling.low_freq_factor), jnp.float32(scaling.high_freq_factor)
    wavelen = jnp.float32(2 * np.pi) / inv
    scaled = jnp.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return jnp.where(medium, smoothed, scaled)


def rope_tables(positions: jax.Array, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> Rope:
    """cos, sin [T, hd] for rotate-half RoPE; computed once per step, shared by all layers of
    the same base and scaling."""
    inv_freq = inv_frequencies(head_dim, theta, scaling)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def layer_ropes(positions: jax.Array, cfg: ModelConfig) -> list[Rope]:
    """Each layer's RoPE tables, one computation per distinct (base, scaling) (Gemma 3's local
    and global layers differ)."""
    tables: dict[tuple[float, RopeScaling | None], Rope] = {}
    out = []
    for i in range(cfg.num_hidden_layers):
        key = cfg.layer_rope(i)
        if key not in tables:
            tables[key] = rope_tables(positions, cfg.head_dim, *key)
        out.append(tables[key])
    return out


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T,H,hd] rotated by position (rotate-half pairing: i with i + hd/2)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x.astype(jnp.float32) * cos[:, None, :] + rotated.astype(jnp.float32) * sin[:, None, :]
    return out.astype(x.dtype)


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """The gated MLP's activation by its config name: SwiGLU's silu, GeGLU's tanh GELU."""
    if name == "gelu_pytorch_tanh":
        return functools.partial(jax.nn.gelu, approximate=True)
    return jax.nn.silu


def mlp(x: jax.Array, lp: Layer, matmul: Matmul | None = None, act: str = "silu") -> jax.Array:
    """The gated MLP: down(act(gate(x)) * up(x)) (SwiGLU, or GeGLU with act gelu_pytorch_tanh),
    gate and up as one [F,2,D] matmul where fused; a mixture-of-experts layer's experts."""
    if lp.moe is not None:
        return moe_mlp(x, lp.moe, activation(act))
    if lp.w_gate_up is not None:
        gu = linear(x, lp.w_gate_up, matmul)  # [T, F, 2]
        g, u = gu[..., 0], gu[..., 1]
    else:
        assert lp.w_gate is not None and lp.w_up is not None
        g, u = linear(x, lp.w_gate, matmul), linear(x, lp.w_up, matmul)
    assert lp.w_down is not None
    return linear(activation(act)(g) * u, lp.w_down, matmul)


def qkv_projections(
    h: jax.Array, lp: Layer, cfg: ModelConfig, matmul: Matmul | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [T,Hq,hd], k and v [T,Hk,hd] of normed h, before RoPE: one fused matmul, or three where
    the layer keeps them apart (tensor parallel with replicated KV heads; a GGUF storing them in
    different formats)."""
    T, hd, hq, hk = h.shape[0], cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    if lp.wqkv is not None:  # [Hk, G+2, hd, D]: per KV head, its G query heads, its k, its v
        qkv = linear(h, lp.wqkv, matmul)
        if lp.bqkv is not None:
            qkv = qkv + lp.bqkv.value
        g = hq // hk
        q, k, v = qkv[:, :, :g].reshape(T, hq, hd), qkv[:, :, g], qkv[:, :, g + 1]
    else:
        assert lp.wq is not None and lp.wk is not None and lp.wv is not None
        q, k, v = linear(h, lp.wq, matmul), linear(h, lp.wk, matmul), linear(h, lp.wv, matmul)
        if lp.bq is not None and lp.bk is not None and lp.bv is not None:
            q, k, v = q + lp.bq.value, k + lp.bk.value, v + lp.bv.value
        q, k, v = q.reshape(T, hq, hd), k.reshape(T, hk, hd), v.reshape(T, hk, hd)
    return q, k, v


def _qkv(
    h: jax.Array, lp: Layer, cfg: ModelConfig, rope: Rope, matmul: Matmul | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k, v ready for attention: per-head norms (Qwen3, Gemma 3), RoPE, and q scaled so that
    the kernels' 1/sqrt(hd) makes the model's softmax scale (Gemma's query_pre_attn_scalar)."""
    q, k, v = qkv_projections(h, lp, cfg, matmul)
    if lp.q_norm is not None and lp.k_norm is not None:
        q, k = rms_norm(q, lp.q_norm.value, cfg.rms_norm_eps), rms_norm(k, lp.k_norm.value, cfg.rms_norm_eps)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    if cfg.query_scale:
        q = (q.astype(jnp.float32) * np.float32(cfg.attn_scale * cfg.head_dim**0.5)).astype(q.dtype)
    return q, k, v


def _layer(
    x: jax.Array,
    lp: Layer,
    cfg: ModelConfig,
    rope: Rope,
    attend: Attend,
    matmul: Matmul | None = None,
) -> jax.Array:
    h = rms_norm(x, lp.attn_norm.value, cfg.rms_norm_eps)
    a = linear(attend(*_qkv(h, lp, cfg, rope, matmul)).reshape(x.shape[0], cfg.q_size), lp.wo, matmul)
    if lp.attn_post_norm is not None:
        a = rms_norm(a, lp.attn_post_norm.value, cfg.rms_norm_eps)
    x = x + a
    m = mlp(rms_norm(x, lp.mlp_norm.value, cfg.rms_norm_eps), lp, matmul, cfg.hidden_act)
    if lp.mlp_post_norm is not None:
        m = rms_norm(m, lp.mlp_post_norm.value, cfg.rms_norm_eps)
    return x + m


def embed(params: Weights, cfg: ModelConfig, token_ids: jax.Array) -> jax.Array:
    """The tokens' embedding rows in the activation dtype; Gemma's scaled by sqrt(hidden_size)
    (the scale rounded to that dtype first, as transformers does)."""
    x = params.embed.rows(token_ids).astype(params.act_dtype)
    if cfg.embed_scale:
        x = x * jnp.asarray(cfg.hidden_size**0.5, dtype=x.dtype)
    return x


def lm_logits(params: Weights, cfg: ModelConfig, hidden: jax.Array, matmul: Matmul | None = None) -> jax.Array:
    """Final norm then the LM head: hidden [N,D] -> float32 logits [N,V]; `matmul` first, as in
    `linear` (the native few-row kernel ran a whole decode step 1.04x faster at 1 row, 1.11x at
    4 and 1.06x at 16 than XLA's dot here, alternated in one process)."""
    h = rms_norm(hidden, params.final_norm.value, cfg.rms_norm_eps)
    head = params.head()
    if matmul is not None and (y := matmul(h, head)) is not None:
        return y.astype(jnp.float32)
    return head.logits(h)


def forward(
    params: Weights,
    cfg: ModelConfig,
    token_ids: jax.Array,
    positions: jax.Array,
    kv: tuple[jax.Array, jax.Array],
    kv_blocks: jax.Array,
    kv_offsets: jax.Array,
    meta: AttnMetadata,
    attention: PagedAttention = paged_attention,
    matmul: Matmul | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Paged forward over a flat token axis.

    token_ids, positions, kv_blocks, kv_offsets: [T] (the cache slot of token t is
    (kv_blocks[t], kv_offsets[t])). kv: (k, v) in kernels/paged_attention.py's stored layout; each
    layer's new keys are written in place (donated buffers) before its attention reads them.
    attention: kernels/paged_attention.py's `PagedAttention` (kernels/select.py picks one);
    matmul: the float layer matmuls' implementation (None: XLA's dot; kernels/select.py).
    Returns (hidden [T,D] before the final norm, updated kv).
    """
    ropes = layer_ropes(positions, cfg)
    x = embed(params, cfg, token_ids)
    k_cache, v_cache = kv
    for layer, lp in enumerate(params.layers):  # unrolled: see the module docstring
        layer_meta = dataclasses.replace(meta, window=w) if (w := cfg.window(layer)) else meta

        def attend(
            q: jax.Array, k: jax.Array, v: jax.Array, layer: int = layer, lm: AttnMetadata = layer_meta
        ) -> jax.Array:
            nonlocal k_cache, v_cache
            k_cache = write_kv(k_cache, "k", layer, kv_blocks, kv_offsets, _to_storage(k, k_cache.dtype))
            v_cache = write_kv(v_cache, "v", layer, kv_blocks, kv_offsets, _to_storage(v, v_cache.dtype))
            return attention(AttnArgs(q, k, v, k_cache, v_cache, jnp.int32(layer), lm))

        x = _layer(x, lp, cfg, ropes[layer], attend, matmul)
    return x, (k_cache, v_cache)


def _to_storage(x: jax.Array, storage: Any) -> jax.Array:
    """bf16 KV is stored as uint16 bits (x rounded to bf16 first): XLA:CPU scatters into a donated
    bf16 buffer by copying."""
    if storage == jnp.uint16:
        return lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(storage)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int = 0) -> jax.Array:
    """Causal GQA attention of one sequence: q [T,Hq,hd], k/v [T,Hk,hd] -> [T,Hq,hd]; window > 0:
    each query sees its last `window` positions only (itself included)."""
    T, Hq, hd = q.shape
    G = Hq // k.shape[1]
    qg = q.reshape(T, k.shape[1], G, hd).astype(jnp.float32)
    s = jnp.einsum("tkgd,skd->kgts", qg, k.astype(jnp.float32)) / np.sqrt(hd)
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))
    if window:
        causal = causal & ~jnp.tril(jnp.ones((T, T), dtype=bool), -window)
    p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
    o = jnp.einsum("kgts,skd->tkgd", p, v.astype(jnp.float32))
    return o.reshape(T, Hq, hd).astype(q.dtype)


def forward_dense(
    params: Weights, cfg: ModelConfig, token_ids: jax.Array, matmul: Matmul | None = None
) -> tuple[jax.Array, jax.Array]:
    """One sequence at positions 0..T-1, no cache: (final-normed hidden [T,D], logits [T,V]);
    `matmul` as in `linear` (a runner's, to compare its matmuls on one path)."""
    ropes = layer_ropes(jnp.arange(token_ids.shape[0], dtype=jnp.int32), cfg)
    x = embed(params, cfg, token_ids)
    for i, lp in enumerate(params.layers):
        attend = functools.partial(dense_attention, window=cfg.window(i))
        x = _layer(x, lp, cfg, ropes[i], attend, matmul)
    return rms_norm(x, params.final_norm.value, cfg.rms_norm_eps), lm_logits(params, cfg, x, matmul)
