"""Token selection inside the compiled step: a pure function of logits, per-row settings and seeds.

Owns: penalties and logit_bias, temperature, top-k, top-p, min-p, the seeded draw, draft
verification for speculative decoding, the chosen token's logprob, and top-k logprobs (a
separate function, run only when a request asks). Must not: touch the KV cache, know about
buckets or requests (the runner packs `SamplingBatch`/`Penalties`), or sort the vocab axis:
XLA:CPU sort and lax.top_k cost ~13 ms per 49k row, so top-k and top-p are thresholds found
by bisection over float32 bit patterns (exact in 31 halvings; non-negative floats order like
their bits), followed by one inverse-CDF draw.
Tested by tests/runtime/test_sampler.py.

Processing order for a row: the structured-output bitmask (blocked tokens -inf: everything
after, logprobs included, sees the constrained distribution; an unconstrained row's mask
allows every token and changes nothing), logit_bias, repetition penalty, frequency and presence penalties
(penalties count the output so far plus the drafts before this row), then greedy argmax when
temperature == 0, else softmax(logits / temperature) -> top-k -> top-p (over the top-k mass)
-> min-p (relative to the most likely token). Ties at a threshold are all kept.
Randomness: row key = fold_in(key(seed), step) with step = num_generated + j, so a request's
samples do not depend on its batch neighbours.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels.paged_attention import Operand
from tl.core.request import SamplingParams
from tl.model import rowwise

BISECT_STEPS = 31  # bit patterns of floats in [0, 1] span < 2**30: 31 halvings pin one exactly


@dataclass(frozen=True)
class SamplingBatch:
    """Per sample row r: settings of the row's request and the row's draft."""

    temperature: Operand  # [R] f32; 0 = greedy
    top_p: Operand  # [R] f32; 1 = off
    top_k: Operand  # [R] i32; 0 = off
    min_p: Operand  # [R] f32; 0 = off
    key_data: Operand  # [R, 2] uint32: threefry key of the request seed (hi, lo words)
    step: Operand  # [R] i32: num_generated + j, folded into the key
    draft: Operand  # [R] i32: draft token this row verifies, -1 for none


@dataclass(frozen=True)
class Penalties:
    """Output-token statistics for penalties; `enabled` False skips all of it (lax.cond)."""

    enabled: Operand  # [] bool
    counts: Operand  # [S, V] f32: occurrences of each token in the sequence's output so far
    bias: Operand  # [S, V] f32: logit_bias
    presence: Operand  # [S] f32
    frequency: Operand  # [S] f32
    repetition: Operand  # [S] f32; 1 = off
    row_seq: Operand  # [R] i32: sequence of each sample row
    prior_drafts: Operand  # [R, K] i32: drafts before this row in its sequence (-1 pad)


@dataclass(frozen=True)
class SampleOut:
    token: jax.Array  # [R] i32: the draft when accepted, else the sampled (or greedy) token
    logprob: jax.Array  # [R] f32: log_softmax(raw logits)[token]
    accepted: jax.Array  # [R] bool: the row's draft was accepted


for _cls in (SamplingBatch, Penalties, SampleOut):
    jax.tree_util.register_dataclass(_cls)


def apply_penalties(logits: jax.Array, pen: Penalties) -> jax.Array:
    """logits [R,V] -> penalised logits (OpenAI presence/frequency, HF/vLLM repetition, logit_bias)."""
    R, V = logits.shape
    counts = pen.counts[pen.row_seq]
    drafts = jnp.where(pen.prior_drafts >= 0, pen.prior_drafts, V)
    counts = counts.at[jnp.arange(R)[:, None], drafts].add(1.0, mode="drop")
    x = logits + pen.bias[pen.row_seq]
    seen = counts > 0
    rep = pen.repetition[pen.row_seq][:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
    out: jax.Array = x - counts * pen.frequency[pen.row_seq][:, None] - seen * pen.presence[pen.row_seq][:, None]
    return out


def _bisect(bits: jax.Array, hi: jax.Array, ok_fn: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Largest b in [lo=0, hi) per row with ok(b); ok is monotone (true at 0, false at hi)."""
    lo = jnp.zeros_like(hi)

    def body(_: int, lh: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = lh
        mid = lo + (hi - lo) // 2
        ok = ok_fn(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    best: jax.Array = lax.fori_loop(0, BISECT_STEPS, body, (lo, hi))[0]
    return best


def _top_k_bits(p_bits: jax.Array, k: jax.Array) -> jax.Array:
    """Bit pattern of the k-th largest probability per row (0 where k == 0)."""
    k = jnp.where(k > 0, jnp.minimum(k, p_bits.shape[1]), 0)

    def ok(b: jax.Array) -> jax.Array:
        return jnp.sum(p_bits >= b[:, None], axis=1) >= k

    return jnp.where(k > 0, _bisect(p_bits, p_bits.max(axis=1) + 1, ok), 0)


def _top_p_bits(p: jax.Array, p_bits: jax.Array, floor: jax.Array, top_p: jax.Array) -> jax.Array:
    """Bit pattern of the smallest probability in the top-p nucleus of the tokens >= floor."""
    kept = jnp.where(p_bits >= floor[:, None], p, 0.0)
    target = top_p * rowwise.row_sum(kept)

    def ok(b: jax.Array) -> jax.Array:
        return (b <= floor) | (rowwise.row_sum(jnp.where(p_bits >= b[:, None], kept, 0.0)) >= target)

    return jnp.where(top_p < 1.0, _bisect(p_bits, p_bits.max(axis=1) + 1, ok), 0)


def _truncate(p: jax.Array, sb: SamplingBatch) -> jax.Array:
    """p [R,V] with tokens outside top-k, top-p and min-p zeroed (not renormalised)."""
    p_bits = lax.bitcast_convert_type(p, jnp.int32)
    zero = jnp.zeros(p.shape[0], jnp.int32)
    k_bits = lax.cond(jnp.any(sb.top_k > 0), _top_k_bits, lambda *_: zero, p_bits, sb.top_k)
    p_bits_floor = lax.cond(jnp.any(sb.top_p < 1.0), _top_p_bits, lambda *_: zero, p, p_bits, k_bits, sb.top_p)
    min_bits = lax.bitcast_convert_type(sb.min_p * p.max(axis=1), jnp.int32)
    floor = jnp.maximum(jnp.maximum(k_bits, p_bits_floor), min_bits)
    return jnp.where(p_bits >= floor[:, None], p, 0.0)


def _draw(q: jax.Array, u: jax.Array) -> jax.Array:
    """Inverse-CDF draw from unnormalised q [R,V] with uniforms u [R] in [0, 1)."""
    cdf = rowwise.cumsum(q)
    idx = jnp.minimum(jnp.sum(cdf <= (u * cdf[:, -1])[:, None], axis=1), q.shape[1] - 1)
    hit = jnp.take_along_axis(q, idx[:, None], axis=1)[:, 0] > 0
    return jnp.where(hit, idx, jnp.argmax(q, axis=1)).astype(jnp.int32)  # float edge: most likely token


def _uniforms(sb: SamplingBatch) -> jax.Array:
    """[R, 2] uniforms per row: accept test, draw. Depend only on (seed, step)."""
    keys = jax.random.wrap_key_data(sb.key_data, impl="threefry2x32")
    keys = jax.vmap(jax.random.fold_in)(keys, sb.step)
    return jax.vmap(lambda k: jax.random.uniform(k, (2,)))(keys)


def allowed(mask: jax.Array, vocab: int) -> jax.Array:
    """[R, W] int32 bitmask (bit b of word w: token 32w + b, 1 = allowed) -> [R, vocab] bool."""
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(mask.shape[0], -1)[:, :vocab].astype(bool)


def apply_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """logits [R,V] with the tokens a row's bitmask blocks set to -inf."""
    return jnp.where(allowed(mask, logits.shape[1]), logits, -jnp.inf)


ArgmaxLse = Callable[[jax.Array], tuple[jax.Array, jax.Array]]
"""logits [R,V] -> (first argmax [R] int32, logsumexp [R] f32): a backend's one-pass kernel."""


def argmax_lse(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jnp.argmax(x, axis=1).astype(jnp.int32), rowwise.logsumexp(x)


def sample(logits: jax.Array, sb: SamplingBatch, pen: Penalties, argmax_lse_fn: ArgmaxLse | None = None) -> SampleOut:
    """Tokens for each row of logits [R,V] (float32).

    Greedy rows accept a draft iff it is the argmax. Sampled rows accept draft d with
    probability q(d) under the processed, truncated, renormalised distribution q, else draw
    from q with d removed and renormalised: the result is distributed exactly as q (drafts
    are deterministic proposals). The logprob is of the RAW distribution, log_softmax(logits)
    before penalties, temperature and truncation (what OpenAI's `logprobs` reports).
    argmax_lse_fn: the argmax and logsumexp of the raw logits in one pass (kernels/select.py:
    the native CPU kernel; default jnp). Penalised rows take a jnp argmax of their own.
    """
    raw_tok, lse = (argmax_lse_fn or argmax_lse)(logits)

    def general() -> tuple[jax.Array, jax.Array]:
        x = lax.cond(pen.enabled, apply_penalties, lambda lg, _: lg, logits, pen)
        greedy_tok = lax.cond(pen.enabled, lambda: jnp.argmax(x, axis=1).astype(jnp.int32), lambda: raw_tok)
        out: tuple[jax.Array, jax.Array] = lax.cond(
            jnp.all(sb.temperature <= 0), lambda: _greedy(greedy_tok, sb), lambda: _sampled(x, greedy_tok, sb)
        )
        return out

    # All rows greedy without penalties (the common serving case): the raw argmax only, skipping
    # the softmax, the truncation bisections and the draw (41 ms of a 64-row step on 2 cores),
    # and the conds' copies of the logits (~0.9 ms of a one-row step).
    token, accepted = lax.cond(jnp.all(sb.temperature <= 0) & ~pen.enabled, lambda: _greedy(raw_tok, sb), general)
    logprob = jnp.take_along_axis(logits, token[:, None], axis=1)[:, 0] - lse
    return SampleOut(token=token, logprob=logprob, accepted=accepted)


def _greedy(greedy_tok: jax.Array, sb: SamplingBatch) -> tuple[jax.Array, jax.Array]:
    """(token, accepted) when every row is greedy: a draft is accepted iff it is the argmax."""
    accepted = (sb.draft >= 0) & (greedy_tok == sb.draft)
    return jnp.where(accepted, sb.draft, greedy_tok), accepted


def _sampled(x: jax.Array, greedy_tok: jax.Array, sb: SamplingBatch) -> tuple[jax.Array, jax.Array]:
    """(token, accepted) for a batch with at least one sampled row (greedy rows as in `_greedy`)."""
    temp = jnp.where(sb.temperature > 0, sb.temperature, 1.0)
    q = _truncate(rowwise.softmax(x / temp[:, None]), sb)
    has_draft = sb.draft >= 0
    d = jnp.where(has_draft, sb.draft, 0)
    q_d = jnp.take_along_axis(q, d[:, None], axis=1)[:, 0]
    u = _uniforms(sb)
    accept_sampled = has_draft & (u[:, 0] * rowwise.row_sum(q) < q_d)
    without_d = jnp.where(has_draft[:, None] & (jnp.arange(q.shape[1])[None, :] == d[:, None]), 0.0, q)
    drawn = _draw(jnp.where(rowwise.row_sum(without_d, keepdims=True) > 0, without_d, q), u[:, 1])
    greedy = sb.temperature <= 0
    accepted = jnp.where(greedy, has_draft & (greedy_tok == d), accept_sampled)
    return jnp.where(accepted, d, jnp.where(greedy, greedy_tok, drawn)), accepted


def top_logprobs(logits: jax.Array, k: int, argmax_lse_fn: ArgmaxLse | None = None) -> tuple[jax.Array, jax.Array]:
    """The k most likely tokens per row of the raw distribution: (ids [R,k] i32, logprobs [R,k]).

    k rounds of argmax-and-mask instead of lax.top_k (a sort on CPU); run only when asked. The
    logsumexp is `sample`'s (argmax_lse_fn, default jnp): the sampled token's logprob and its
    entry here are the same number, bit for bit, whichever kernel computes it.
    """
    lp = logits - (argmax_lse_fn or argmax_lse)(logits)[1][:, None]

    def body(x: jax.Array, _: None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        i = jnp.argmax(x, axis=1)
        v = jnp.take_along_axis(x, i[:, None], axis=1)[:, 0]
        return x.at[jnp.arange(x.shape[0]), i].set(-jnp.inf), (i.astype(jnp.int32), v)

    _, (ids, vals) = lax.scan(body, lp, None, length=k)
    return ids.T, vals.T


def pack_rows(
    params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int], drafts: Sequence[int], num_rows: int
) -> SamplingBatch:
    """Host arrays for `num_rows` sample rows; rows past len(params) are greedy padding."""
    n = len(params)
    pad = num_rows - n

    def col(values: list[float] | list[int], fill: float, dtype: type) -> np.ndarray:
        return np.array(list(values) + [fill] * pad, dtype)

    seeds_u = np.array(list(seeds) + [0] * pad, np.uint64)
    key_data = np.stack(
        [(seeds_u >> np.uint64(32)).astype(np.uint32), (seeds_u & np.uint64(0xFFFFFFFF)).astype(np.uint32)], 1
    )
    return SamplingBatch(
        temperature=col([p.temperature for p in params], 0.0, np.float32),
        top_p=col([p.top_p for p in params], 1.0, np.float32),
        top_k=col([p.top_k for p in params], 0, np.int32),
        min_p=col([p.min_p for p in params], 0.0, np.float32),
        key_data=key_data,
        step=col(list(steps), 0, np.int32),
        draft=col(list(drafts), -1, np.int32),
    )


def pack_penalties(
    params: Sequence[SamplingParams],
    output_ids: Sequence[Sequence[int]],
    row_seq: Sequence[int],
    prior_drafts: Sequence[Sequence[int]],
    num_seqs: int,
    num_rows: int,
    max_prior: int,
    vocab_size: int,
) -> Penalties:
    """Host arrays of penalties for `num_seqs` sequences (padded) and `num_rows` rows (padded)."""
    counts = np.zeros((num_seqs, vocab_size), np.float32)
    bias = np.zeros((num_seqs, vocab_size), np.float32)
    per_seq = np.zeros((3, num_seqs), np.float32)
    per_seq[2] = 1.0
    for s, (p, out) in enumerate(zip(params, output_ids, strict=True)):
        np.add.at(counts[s], np.asarray(out, np.int64), 1.0)
        for tok, b in p.logit_bias:
            if 0 <= tok < vocab_size:
                bias[s, tok] = b
        per_seq[:, s] = (p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
    rows = np.zeros(num_rows, np.int32)
    rows[: len(row_seq)] = row_seq
    prior = np.full((num_rows, max_prior), -1, np.int32)
    for r, ds in enumerate(prior_drafts):
        prior[r, : len(ds)] = ds
    return Penalties(
        enabled=np.bool_(any(p.has_penalties for p in params)),
        counts=counts,
        bias=bias,
        presence=per_seq[0],
        frequency=per_seq[1],
        repetition=per_seq[2],
        row_seq=rows,
        prior_drafts=prior,
    )
