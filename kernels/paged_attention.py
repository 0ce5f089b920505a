"""Attention of a flat, ragged token axis over a paged KV cache: one interface, a plain-jnp reference.

Owns: the one call every implementation has (`PagedAttention`: one `AttnArgs` -> [T,Hq,hd]),
`AttnMetadata` (the step's layout inside it) and `paged_attention`, the reference that
accelerator kernels (Pallas, issue 6) and the native CPU one must match. Must not: write the
cache (the model writes this step's keys before calling), know about requests or buckets.
Tested by tests/helpers/attention_cases.py against a naive gather-everything-and-mask reference.
Not batch invariant: its sums over a step's keys follow the step's shapes and where a chunk
begins (the native CPU kernel computes every token alone; README, "Same request, same answer").

The token axis mixes sequences: prefill chunks, decodes, drafts, padding. Token t belongs to
sequence `seq_idx[t]` (-1 for padding), sits at `positions[t]`, and sees keys at positions <=
its own in its sequence; with a sliding window w (`AttnMetadata.window` > 0, a static per-layer
field) only those at positions > its own - w (Hugging Face's `kv_idx > q_idx - sliding_window`,
llama.cpp's n_swa). Those keys are split in two parts, merged by log-sum-exp:
- local: this step's own tokens (a [T,T] masked attention over k_new/v_new: same sequence and
  causal), so a fresh 512-token prefill costs one dense attention, not a per-token gather;
- cached: keys already in the cache at positions < start_pos of the sequence, read chunk by chunk
  through the block table with an online softmax; the trip count is the batch's longest cached
  context (dynamic), because on CPU attention cost follows the padded context. Two forms, chosen
  by the (static) number of sequences S: per token (each token gathers its sequence's chunk:
  cost ~ T x context, XLA:CPU's gather moves ~4 GB/s) or, for S <= SEQ_DENSE_MAX_SEQS, per
  sequence (each sequence's chunk gathered once, every token scored against all S chunks as one
  matmul and masked: cost ~ T x S x context in FLOPs). Per layer, context 256-384: a 512-token
  chunk over 4 sequences 85 -> 14 ms, one sequence with 5 draft rows 1.6 -> 0.4 ms; at S = 16
  the two are even and at S = 64 per token is 9x cheaper.
Cache layout. Logically K and V are [L, num_blocks, block_size, Hk, hd]; stored, each block keeps
its KV heads outermost, K transposed: K [L, NB, Hk, hd, bs], V [L, NB, Hk, bs, hd] (`K_AXES`,
`V_AXES`; `cache_shape`, `write_kv`, `to_stored`, `layer_pages` are the only places that know).
Why: the cached part gathers blocks with `lax.gather` straight into the operand forms XLA's
batched dots take without a copy (K as [.., Hk, hd, keys], V as [.., Hk, keys, hd]); gathered
from the logical layout, XLA:CPU fused the gather with a transpose of every gathered key and the
cached part cost 25% more at 16-64 decoding sequences (30 layers, context 256, batch 64:
193 -> 147 ms). uint16 caches hold bf16 bits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeAlias

import jax
import jax.numpy as jnp
from jax import lax

SEQ_DENSE_MAX_SEQS = 4  # up to this many sequences per step the cached part is computed per sequence


Operand: TypeAlias = Any
"""A record field: a host numpy array as the runner packs it, a jax.Array (or its
ShapeDtypeStruct) under trace."""


@dataclass(frozen=True)
class AttnMetadata:
    """Per-step layout of the token axis (a pytree; `chunk_blocks`, `head_rows`, `window` are static).

    Each sequence's tokens are contiguous on the axis and in position order, padding last
    (tl/runtime/runner.py packs them so; the TPU kernel relies on it).
    """

    seq_idx: Operand  # [T] int32: sequence of each token, -1 for padding
    positions: Operand  # [T] int32: position of each token in its sequence
    start_pos: Operand  # [S] int32: tokens of each sequence already in the cache before this step
    block_tables: Operand  # [S, max_blocks] int32: block ids, unused entries any valid block
    chunk_blocks: int = 8  # blocks read per iteration of the cached-part loop
    head_rows: int = 0  # if 0 < head_rows < T: the per-token cached part runs rows [:head_rows] and the rest apart
    window: int = 0  # sliding window: a token at p sees keys at p - window < k <= p; 0: all k <= p (per layer)


jax.tree_util.register_dataclass(
    AttnMetadata,
    data_fields=["seq_idx", "positions", "start_pos", "block_tables"],
    meta_fields=["chunk_blocks", "head_rows", "window"],
)


class AttnArgs(NamedTuple):
    """One layer's attention call: what every implementation takes (`PagedAttention`).

    A NamedTuple so that it is a pytree without registration (jit, eval_shape and shard_map's
    specs take it as it is) and unpacks as the seven arguments it replaces.
    """

    q: Operand  # [T, Hq, hd]
    k_new: Operand  # [T, Hk, hd]: this step's keys, already written to the cache
    v_new: Operand  # [T, Hk, hd]
    k_cache: Operand  # [L, NB, Hk, hd, bs] (stored layout; uint16: bf16 bits)
    v_cache: Operand  # [L, NB, Hk, bs, hd]
    layer: Operand  # scalar int32
    meta: AttnMetadata


class PagedAttention(Protocol):
    """The attention interface: `AttnArgs` -> [T, Hq, hd] in q's dtype, with `paged_attention`'s
    contract (kernels/select.py picks the implementation; tl/model/llama.py calls it)."""

    def __call__(self, a: AttnArgs, /) -> jax.Array: ...


K_AXES = (0, 1, 3, 4, 2)  # stored K axes, as logical [L, NB, bs, Hk, hd] axes: [L, NB, Hk, hd, bs]
V_AXES = (0, 1, 3, 2, 4)  # stored V: [L, NB, Hk, bs, hd]


def _is_k(kind: str) -> bool:
    if kind not in ("k", "v"):
        raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
    return kind == "k"


def _axes(kind: str) -> tuple[int, ...]:
    return K_AXES if _is_k(kind) else V_AXES


def cache_shape(kind: str, layers: int, blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """The stored shape of the K or V cache."""
    logical = (layers, blocks, block_size, kv_heads, head_dim)
    return tuple(logical[a] for a in _axes(kind))


def to_stored(kind: str, logical: Any) -> Any:
    """A logical [L, NB, bs, Hk, hd] cache (numpy or jax) in the stored layout (tests, tools)."""
    return logical.transpose(_axes(kind))


def layer_pages(cache: jax.Array, kind: str, layer: jax.Array, dtype: Any) -> jax.Array:
    """One layer of a stored cache as logical pages [NB, bs, Hk, hd] in dtype (uint16 caches hold
    bf16 bits; a copy: for kernels with their own layout)."""
    x = cache[layer]
    return _decode(x.transpose(0, 3, 1, 2) if _is_k(kind) else x.transpose(0, 2, 1, 3), dtype)


def write_kv(
    cache: jax.Array, kind: str, layer: int | jax.Array, blocks: jax.Array, offsets: jax.Array, x: jax.Array
) -> jax.Array:
    """cache with x [T, Hk, hd] written at slots (blocks[t], offsets[t]) of `layer` (in place when donated)."""
    x = x.astype(cache.dtype)
    if _is_k(kind):
        return cache.at[layer, blocks, :, :, offsets].set(x)
    return cache.at[layer, blocks, :, offsets].set(x)


def _decode(x: jax.Array, dtype: Any) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.bfloat16).astype(dtype) if x.dtype == jnp.uint16 else x.astype(dtype)


def load_kv(
    cache: jax.Array,
    kind: str,
    layer: jax.Array,
    blocks: jax.Array,
    dtype: Any,
    heads_first: bool = False,
) -> jax.Array:
    """Blocks [N, C] of one layer, gathered and decoded into a dot operand (one gather, no copy of the layer).

    K: [N, Hk, hd, C*bs], V: [N, Hk, C*bs, hd]; with heads_first, K: [Hk, hd, N*C*bs], V: [Hk, N*C*bs, hd].
    """
    N = blocks.shape[0]
    idx = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, blocks.dtype), blocks.shape), blocks], axis=-1)
    slice_sizes = (1, 1, *cache.shape[2:])
    is_k = _is_k(kind)
    if is_k:  # slice [Hk, hd, bs]
        offset_dims = (0, 1, 4) if heads_first else (1, 2, 4)
    else:  # slice [Hk, bs, hd]
        offset_dims = (0, 3, 4) if heads_first else (1, 3, 4)
    dn = lax.GatherDimensionNumbers(offset_dims=offset_dims, collapsed_slice_dims=(0, 1), start_index_map=(0, 1))
    x = lax.gather(cache, idx, dn, slice_sizes, mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    hk = cache.shape[2]
    if heads_first:
        shape = (hk, cache.shape[3], -1) if is_k else (hk, -1, cache.shape[4])
    else:
        shape = (N, hk, cache.shape[3], -1) if is_k else (N, hk, -1, cache.shape[4])
    return _decode(x.reshape(shape), dtype)


def local_state(qg: jax.Array, k: jax.Array, v: jax.Array, meta: AttnMetadata) -> tuple[jax.Array, ...]:
    """Softmax state (m, l [T,Hk,G], acc [T,Hk,G,hd]) of each token over this step's tokens.

    Computed as Hk matmuls [T*G, hd] x [hd, T] (query rows of a KV head stacked): the direct
    "tkgd,ukd->tkgu" einsum lowers to tiny per-token dots on XLA:CPU, 4x slower at T=512.
    (Row blocks that skip the keys after each block were tried: 36/64 of the work at T=512, no
    measurable change to a whole prefill step, ~5 s more compile per large variant.)
    """
    T, Hk, G, hd = qg.shape
    q2 = qg.transpose(1, 0, 2, 3).reshape(Hk, T * G, hd)
    s = jnp.einsum("kmd,ukd->kmu", q2, k).reshape(Hk, T, G, T)
    same = (meta.seq_idx[:, None] == meta.seq_idx[None, :]) & (meta.positions[None, :] <= meta.positions[:, None])
    if meta.window:
        same &= meta.positions[None, :] > meta.positions[:, None] - meta.window
    s = jnp.where(same[None, :, None, :], s, -jnp.inf)  # the diagonal is always kept: m is finite
    m = s.max(axis=-1)
    p = jnp.exp(s - m[..., None])
    acc = jnp.einsum("kmu,ukd->kmd", p.reshape(Hk, T * G, T), v).reshape(Hk, T, G, hd)
    return m.transpose(1, 0, 2), p.sum(axis=-1).transpose(1, 0, 2), acc.transpose(1, 0, 2, 3)


def _first_chunk(meta: AttnMetadata, ctx: jax.Array, c: int, num_chunks: jax.Array) -> int | jax.Array:
    """The cached-part loop's first chunk of c keys: 0 without a window; with one, the first chunk
    some token still sees (its window's first key, max(0, pos - window + 1), below its context
    ctx [T], 0 for padding), so chunks that every window has left behind are skipped. Exact: a
    skipped chunk holds no key any token sees."""
    if not meta.window:
        return 0
    lo = jnp.maximum(meta.positions - meta.window + 1, 0)  # [T]: each token's first key
    first = jnp.min(jnp.where(lo < ctx, lo, jnp.iinfo(jnp.int32).max)) // c
    return jnp.minimum(first, num_chunks)


def _cached_per_token(qg: jax.Array, a: AttnArgs, state: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Fold keys at positions < start_pos into the softmax state, chunk_blocks blocks at a time
    (qg: a.q grouped and scaled, `grouped_query`; the cache, layer and metadata from a)."""
    k_cache, v_cache, layer, meta = a.k_cache, a.v_cache, a.layer, a.meta
    C, bs = meta.chunk_blocks, k_cache.shape[4]
    real = meta.seq_idx >= 0
    seq = jnp.where(real, meta.seq_idx, 0)
    ctx = jnp.where(real, meta.start_pos[seq], 0)  # [T]
    tables = meta.block_tables[seq]  # [T, MB]
    pad = -tables.shape[1] % C
    tables = jnp.pad(tables, ((0, 0), (0, pad)), mode="edge")
    num_chunks = (jnp.max(ctx) + C * bs - 1) // (C * bs)
    first = _first_chunk(meta, ctx, C * bs, num_chunks)

    def body(i: jax.Array, st: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        m, l, acc = st
        blocks = lax.dynamic_slice_in_dim(tables, i * C, C, axis=1)  # [T, C]
        kc = load_kv(k_cache, "k", layer, blocks, qg.dtype)  # [T, Hk, hd, C*bs]
        vc = load_kv(v_cache, "v", layer, blocks, qg.dtype)  # [T, Hk, C*bs, hd]
        s = jnp.einsum("tkgd,tkdc->tkgc", qg, kc)
        keys = i * C * bs + jnp.arange(C * bs)[None, :]  # [1, C*bs]: positions of the chunk's keys
        valid = keys < ctx[:, None]
        if meta.window:
            valid &= keys > meta.positions[:, None] - meta.window
        s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        return m_new, l * corr + p.sum(axis=-1), acc * corr[..., None] + jnp.einsum("tkgc,tkcd->tkgd", p, vc)

    return lax.fori_loop(first, num_chunks, body, state)


def _cached_per_seq(qg: jax.Array, a: AttnArgs, state: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """As `_cached_per_token`, gathering each sequence's chunk once: scores [Hk, T*G, S*c], masked."""
    k_cache, v_cache, layer, meta = a.k_cache, a.v_cache, a.layer, a.meta
    C, bs = meta.chunk_blocks, k_cache.shape[4]
    T, Hk, G, hd = qg.shape
    S, c = meta.block_tables.shape[0], C * bs
    tables = jnp.pad(meta.block_tables, ((0, 0), (0, -meta.block_tables.shape[1] % C)), mode="edge")
    q2 = qg.transpose(1, 0, 2, 3).reshape(Hk, T * G, hd)
    ctx = meta.start_pos  # [S]; padding sequences have 0
    own = meta.seq_idx[:, None] == jnp.arange(S)[None, :]  # [T, S]; padding tokens own nothing
    num_chunks = (jnp.max(ctx) + c - 1) // c
    first = _first_chunk(meta, jnp.where(meta.seq_idx >= 0, ctx[jnp.maximum(meta.seq_idx, 0)], 0), c, num_chunks)

    def body(i: jax.Array, st: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        m, l, acc = st  # [Hk, T, G], [Hk, T, G], [Hk, T, G, hd]
        blocks = lax.dynamic_slice_in_dim(tables, i * C, C, axis=1)  # [S, C]
        kc = load_kv(k_cache, "k", layer, blocks, qg.dtype, heads_first=True)  # [Hk, hd, S*c]
        vc = load_kv(v_cache, "v", layer, blocks, qg.dtype, heads_first=True)  # [Hk, S*c, hd]
        s = jnp.einsum("kmd,kdn->kmn", q2, kc).reshape(Hk, T, G, S, c)
        valid = own[:, :, None] & (i * c + jnp.arange(c)[None, None, :] < ctx[None, :, None])  # [T, S, c]
        if meta.window:  # keys at positions > the token's - window
            valid &= i * c + jnp.arange(c)[None, None, :] > meta.positions[:, None, None] - meta.window
        s = jnp.where(valid[None, :, None], s, -jnp.inf).reshape(Hk, T, G, S * c)
        m_new = jnp.maximum(m, s.max(axis=-1))  # m is finite: the local part kept the diagonal
        corr = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        pv = jnp.einsum("kmn,knd->kmd", p.reshape(Hk, T * G, S * c), vc).reshape(Hk, T, G, hd)
        return m_new, l * corr + p.sum(axis=-1), acc * corr[..., None] + pv

    m, l, acc = lax.fori_loop(first, num_chunks, body, tuple(x.swapaxes(0, 1) for x in state))
    return m.swapaxes(0, 1), l.swapaxes(0, 1), acc.swapaxes(0, 1)


def _cached_split(qg: jax.Array, a: AttnArgs, state: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """`_cached_per_token` over rows [:H] and [H:] apart, each loop running to its own longest context.

    The runner packs decode (and draft) tokens first, so the head holds the rows with long cached
    contexts and the tail the prompt chunks, mostly fresh (context 0) or short prefix hits. The
    per-token gather costs rows x trip count, so a mixed step of 60 decodes at context 256 and
    450 fresh prompt tokens gathers 60 x 256 keys instead of 512 x 256. Exact for any split.
    """
    meta = a.meta

    def part(rows: slice) -> tuple[jax.Array, ...]:
        sub = dataclasses.replace(meta, seq_idx=meta.seq_idx[rows], positions=meta.positions[rows], head_rows=0)
        return _cached_per_token(qg[rows], a._replace(meta=sub), tuple(x[rows] for x in state))

    head, tail = part(slice(0, meta.head_rows)), part(slice(meta.head_rows, None))
    return tuple(jnp.concatenate([h, t]) for h, t in zip(head, tail, strict=True))


def _cached(qg: jax.Array, a: AttnArgs, state: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """The cached part in the cheaper form for this step's (static) numbers of sequences and rows."""
    if a.meta.block_tables.shape[0] <= SEQ_DENSE_MAX_SEQS:
        return _cached_per_seq(qg, a, state)
    if 0 < a.meta.head_rows < qg.shape[0]:
        return _cached_split(qg, a, state)
    return _cached_per_token(qg, a, state)


def grouped_query(a: AttnArgs) -> jax.Array:
    """q [T,Hq,hd] as float32 [T,Hk,G,hd] (G consecutive query heads a KV head), scaled by 1/sqrt(hd)."""
    T, Hq, hd = a.q.shape
    Hk = a.k_new.shape[1]
    return a.q.reshape(T, Hk, Hq // Hk, hd).astype(jnp.float32) * (hd**-0.5)


def paged_attention(a: AttnArgs) -> jax.Array:
    """Reference (`PagedAttention`): q [T,Hq,hd], k_new/v_new [T,Hk,hd] (this step's keys, already
    written to the cache), k_cache [L,NB,Hk,hd,bs] / v_cache [L,NB,Hk,bs,hd] (stored layout),
    layer: scalar int32 -> [T,Hq,hd] in q's dtype.

    Softmax scale 1/sqrt(hd); GQA groups Hq/Hk consecutive query heads per KV head. Computed in
    float32. Kernels may read this step's keys from the cache instead of k_new/v_new.
    """
    qg = grouped_query(a)
    state = local_state(qg, a.k_new.astype(jnp.float32), a.v_new.astype(jnp.float32), a.meta)
    _, l, acc = _cached(qg, a, state)
    return (acc / l[..., None]).reshape(a.q.shape).astype(a.q.dtype)
