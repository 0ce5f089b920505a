"""Mixture-of-experts MLP layers (Qwen3-MoE; Mixtral's sparse block is the same computation).

Owns: a MoE layer's parameters (`Experts`: the router [E,D] kept float, every expert's fused
gate-up [E,Fm,2,D] and down [E,D,Fm] each as one linear encoding of tl/model/weights.py;
tl/model/loader.py `WeightLoader.experts` loads them from Hugging Face per-expert tensors, a
GGUF's packed expert slices kept packed), and the forward (`moe_mlp`): the router as transformers'
Qwen3MoeSparseMoeBlock computes it (logits in x's dtype, softmax in float32, top-k, optional
renormalization, weights cast to x's dtype), then the experts' SwiGLU in one of four forms,
chosen statically from the sizes (`choose_form`), all batched (never a loop over experts):
"gather" (few tokens: each pair's expert weights gathered, only those dequantized), "tiled"
(pairs sorted by expert, padded to tiles of one expert each, a batched matmul over tiles),
"dense" (every expert on every token, then selected) and "ragged" (pairs sorted by expert,
`lax.ragged_dot_general`: the native grouped matmul on GPU and TPU; on CPU it lowers to a
masked dense product, slower than "dense"). Every form computes in float32 over the experts'
dequantized weights (int8 too: no W8A8 here), so they agree to float32 rounding.
Tensor parallelism: Fm split over "model" (gate-up column-parallel on axis 1; down row-parallel
on its last axis where whole blocks fall on each device, as loader.py's `row_axes`), so every
device holds a slice of every expert; the router whole.
Must not: load weights, place arrays on devices, know about attention or the paged cache.
Tested by tests/model/test_moe.py (every form against a numpy per-token loop over dequantized weights,
within a float32 error bound; a 2-device mesh).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from tl.model import rowwise, tree
from tl.model.encodings.ggml_formats import dequantize
from tl.model.weights import Bf16x3, Blocks, Dense, Int8, Linear, Tensor

Activation = Callable[[jax.Array], jax.Array]


@tree.dataclass
class Experts:
    """One MoE layer: router [E, D] (float), w_gate_up [E, Fm, 2, D] (gate and up rows
    interleaved per expert, as the dense layer's [F, 2, D]), w_down [E, D, Fm]."""

    router: Tensor
    w_gate_up: Linear
    w_down: Linear
    top_k: int = struct.field(pytree_node=False)
    norm_topk_prob: bool = struct.field(pytree_node=False)

    @property
    def num_experts(self) -> int:
        return int(self.router.value.shape[0])


def route(x: jax.Array, e: Experts) -> tuple[jax.Array, jax.Array]:
    """x [T, D] -> (weights [T, k] in x's dtype, expert ids [T, k] int32), as transformers'
    Qwen3MoeTopKRouter: logits x @ router.T (accumulated in float32, rounded to x's dtype as
    F.linear returns them), softmax in float32, top-k, renormalized if norm_topk_prob."""
    w = e.router.value
    logits = lax.dot_general(x, w.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    probs = rowwise.softmax(logits.astype(x.dtype).astype(jnp.float32))
    top, ids = lax.top_k(probs, e.top_k)
    if e.norm_topk_prob:
        top = top / rowwise.row_sum(top, keepdims=True)
    return top.astype(x.dtype), ids.astype(jnp.int32)


def floats(w: Linear) -> jax.Array:
    """The float values [*out, in] of a linear (dequantized inside the step)."""
    if isinstance(w, Int8):
        out: jax.Array = w.q.astype(jnp.float32) * w.scale[..., None]
        return out
    if isinstance(w, Blocks):
        return dequantize(w.fmt.name, w.data)
    assert isinstance(w, Dense | Bf16x3), type(w)
    dense: jax.Array = w.w
    return dense


def take(w: Linear, ids: jax.Array) -> Linear:
    """The linear of experts `ids` [*n] (every array of an expert linear leads with E)."""
    taken: Linear = jax.tree.map(lambda a: a[ids], w)
    return taken


Form = Literal["gather", "dense", "tiled", "ragged"]
TILE_ROWS = 128
"""Rows of a tile of the "tiled" form (each tile one expert's pairs, padded)."""


def choose_form(num_tokens: int, top_k: int, num_experts: int, backend: str | None = None) -> Form:
    """The form `moe_mlp` runs for these static sizes, from timings on XLA:CPU (tests/model/test_moe.py
    lists them):
    - "gather" while the pairs are at most a quarter of the experts (4*T*k <= E): it reads only
      the chosen experts' weights (decode is bound by weight reads: 0.6 vs 3.3 ms at T=1,
      E=64, k=8, D=512, Fm=256); it materializes T*k experts' float weights, and at T*k = E/2
      those copies already cost 4x the dense form;
    - off CPU, "ragged": lax.ragged_dot lowers to a native grouped matmul on GPU and TPU;
    - on CPU ragged_dot lowers to a masked product of every pair with every expert (k times the
      dense form's work: 2-10x slower than "dense" measured), so "tiled" where its padded rows
      (T*k + E*(TILE_ROWS-1)) are at most half of the dense form's T*E, else "dense" (every
      expert on every token, its weights read in place: "tiled" copies each tile's expert, and
      ran 1.1-6x slower than "dense" at T=16..256, E=64, k=8 with tiles of 16 to 128 rows; at
      T=1024 it ran 2x faster)."""
    pairs = num_tokens * top_k
    if 4 * pairs <= num_experts:
        return "gather"
    if (backend or jax.default_backend()) != "cpu":
        return "ragged"
    return "tiled" if 2 * (pairs + num_experts * (TILE_ROWS - 1)) <= num_tokens * num_experts else "dense"


def moe_mlp(x: jax.Array, e: Experts, act: Activation = jax.nn.silu, form: Form | None = None) -> jax.Array:
    """x [T, D] -> [T, D] in x's dtype: sum over each token's top-k experts of its router
    weight (in x's dtype) times down(act(gate(x)) * up(x)), the experts' arithmetic in float32
    over their dequantized weights. form: `choose_form`'s by default (static)."""
    weights, ids = route(x, e)
    form = form or choose_form(x.shape[0], e.top_k, e.num_experts)
    if form == "dense":
        return _dense(x, e, weights, ids, act)
    y = {"gather": _gathered, "tiled": _tiled, "ragged": _grouped}[form](x, e, ids, act)  # [T, k, D]
    yw = y * weights[..., None]
    return functools.reduce(jnp.add, [yw[:, i] for i in range(yw.shape[1])]).astype(x.dtype)  # in k's order


def _gathered(x: jax.Array, e: Experts, ids: jax.Array, act: Activation) -> jax.Array:
    """Few tokens: each of the P = T*k pairs gathers its expert's weights ([P,Fm,2,D], [P,D,Fm])
    for a batched matrix-vector product -> [T, k, D]. The weights are the dots' left operands in
    their stored [out, in] layout (as einsum "td,tkfcd" XLA:CPU copied them transposed first:
    1.5x slower at T=1, E=64, k=8, D=512, Fm=256)."""
    T, k = ids.shape
    pairs = ids.reshape(-1)
    xs = jnp.repeat(x, k, axis=0)  # [P, D]: pair p is token p // k
    wgu = floats(take(e.w_gate_up, pairs))
    gu = _batched(wgu.reshape(T * k, -1, wgu.shape[-1]), xs.astype(wgu.dtype))
    h = _swiglu(gu.reshape(T * k, -1, 2).astype(x.dtype), act)  # [P, Fm]
    wd = floats(take(e.w_down, pairs))
    return _batched(wd, h.astype(wd.dtype)).astype(x.dtype).reshape(T, k, -1)


def _batched(w: jax.Array, v: jax.Array) -> jax.Array:
    """w [P, out, in] . v [P, in] -> [P, out] float32."""
    return lax.dot_general(w, v, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32)


def _grouped(x: jax.Array, e: Experts, ids: jax.Array, act: Activation) -> jax.Array:
    """Many tokens: the T*k pairs sorted by expert, grouped matmuls over the stored [E, *out, in]
    weights (every expert dequantized), unsorted -> [T, k, D]."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=e.num_experts).astype(jnp.int32)
    xs = x[order // k]  # [T*k, D]
    wgu = floats(e.w_gate_up)  # [E, Fm, 2, D]
    E, fm = wgu.shape[0], wgu.shape[1]
    gu = _ragged(xs.astype(wgu.dtype), wgu.reshape(E, fm * 2, -1), sizes).reshape(T * k, fm, 2)
    h = _swiglu(gu.astype(x.dtype), act)
    wd = floats(e.w_down)  # [E, D, Fm]
    y = _ragged(h.astype(wd.dtype), wd, sizes).astype(x.dtype)  # [T*k, D], sorted
    return jnp.zeros_like(y).at[order].set(y).reshape(T, k, -1)


_RAGGED = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


def _ragged(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array:
    """lhs [M, in] (rows grouped by expert, `sizes` [E] rows each) . rhs [E, out, in] -> [M, out]."""
    return lax.ragged_dot_general(lhs, rhs, sizes, _RAGGED, preferred_element_type=jnp.float32)


def _swiglu(gu: jax.Array, act: Activation) -> jax.Array:
    """[..., Fm, 2] (gate, up) -> act(gate) * up [..., Fm]."""
    return act(gu[..., 0]) * gu[..., 1]


def _dense(x: jax.Array, e: Experts, weights: jax.Array, ids: jax.Array, act: Activation) -> jax.Array:
    """Every expert on every token (gate-up as one [T, E*Fm*2] matmul, down batched over
    experts with the weights the left operand), then the chosen ones weighted and summed."""
    wgu, wd = floats(e.w_gate_up), floats(e.w_down)
    E, fm, _, D = wgu.shape
    gu = lax.dot_general(
        x.astype(wgu.dtype), wgu.reshape(-1, D), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
    h = _swiglu(gu.reshape(-1, E, fm, 2).astype(x.dtype), act)  # [T, E, Fm]
    y = _tile_dot(wd, jnp.swapaxes(h, 0, 1).astype(wd.dtype)).astype(x.dtype)  # [E, T, D]
    sel = jnp.sum(jax.nn.one_hot(ids, E, dtype=x.dtype) * weights[..., None], axis=1)  # [T, E]
    return jnp.einsum("etd,te->td", y, sel).astype(x.dtype)


def _tiled(x: jax.Array, e: Experts, ids: jax.Array, act: Activation, rows: int = TILE_ROWS) -> jax.Array:
    """Many tokens, grouped as tiles: the T*k pairs sorted by expert, each expert's group padded
    to whole tiles of `rows` rows, every tile one expert: a batched matmul over tiles with each
    tile's expert weights gathered -> [T, k, D]."""
    T, k = ids.shape
    P, E = T * k, e.num_experts
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    tiles = -(-sizes // rows)  # [E]
    tile_end = jnp.cumsum(tiles)
    num_tiles = -(-(P + E * (rows - 1)) // rows)
    sorted_ids = flat[order]
    rank = jnp.arange(P) - (jnp.cumsum(sizes) - sizes)[sorted_ids]
    row = (tile_end - tiles)[sorted_ids] * rows + rank  # each sorted pair's padded row
    tile_expert = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(num_tiles), side="right"), E - 1)
    xs = jnp.zeros((num_tiles * rows, x.shape[1]), x.dtype).at[row].set(x[order // k])
    xs = xs.reshape(num_tiles, rows, -1)
    wgu = _tile_weights(e.w_gate_up, tile_expert)  # [n, Fm, 2, D]
    gu = _tile_dot(wgu.reshape(num_tiles, -1, wgu.shape[-1]), xs.astype(wgu.dtype))
    h = _swiglu(gu.reshape(num_tiles, rows, -1, 2).astype(x.dtype), act)  # [n, rows, Fm]
    wd = _tile_weights(e.w_down, tile_expert)  # [n, D, Fm]
    y = _tile_dot(wd, h.astype(wd.dtype)).astype(x.dtype).reshape(num_tiles * rows, -1)[row]
    return jnp.zeros_like(y).at[order].set(y).reshape(T, k, -1)


def _tile_dot(w: jax.Array, a: jax.Array) -> jax.Array:
    """w [n, out, in] . a [n, rows, in] -> [n, rows, out] float32, the weights the left operand
    in their stored layout (with them on the right XLA:CPU copied them transposed: 1.2-1.8x
    slower at T=256..1024, E=8..64)."""
    y = lax.dot_general(w, a, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32)
    return jnp.swapaxes(y, 1, 2)


def _tile_weights(w: Linear, tile_expert: jax.Array) -> jax.Array:
    """Float weights of each tile's expert: fewer tiles than experts dequantize only theirs."""
    if tile_expert.shape[0] < w.out_shape[0]:
        return floats(take(w, tile_expert))
    return floats(w)[tile_expert]
