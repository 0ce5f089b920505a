"""Error bounds from float32 arithmetic, and float64 references to measure against.

Owns: the unit roundoff and gamma_n (Higham's bound on n floating-point operations in any
order, with or without fused multiply-adds), `matmul_bound` (a float32 product against the
exact one), `attention64` (a paged attention in float64 with its float32 error bound). These
hold on any IEEE float32 CPU (x86 or ARM, any vector width, any summation order a kernel or
XLA chooses), so no test tolerance is tuned to one host's rounding. Must not import tl.
"""

from __future__ import annotations

import numpy as np

U = 2.0**-24  # float32 unit roundoff
EXP_ERR = 4 * U  # relative error of an exp: the native kernels' polynomial ~2e-7 (3.4 u), XLA's and libm's within it


def gamma(n: float) -> float:
    """gamma_n = n u / (1 - n u): the relative error bound of a sum or dot product of n terms."""
    return n * U / (1 - n * U)


def matmul_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """|x @ w^T computed in float32 - exact| <= gamma_K (|x| @ |w|^T), elementwise, for x [N,K] and
    w [O,K] (any order of the K products' sum)."""
    k = x.shape[-1]
    return gamma(k) * (np.abs(x.astype(np.float64)) @ np.abs(w.reshape(-1, k).astype(np.float64)).T)


def softmax_bound(scores_abs: np.ndarray, v: np.ndarray, head_dim: int) -> float:
    """Bound on |out - exact| of out = softmax(s) @ v computed in float32 by any online or
    two-pass softmax, for one query: scores_abs[j] = sum_d |q_d k_jd| / sqrt(head_dim) of each
    visible key j, v [n, hd] their values.

    Each weight p_j = exp(s_j - m) is off by a relative rho: the score's rounding (gamma_{hd+1}
    of scores_abs, the 1/sqrt(hd) scaling included), the exp's, and one rescale of the running
    sums per block (at most one per key) plus the merge of two parts and the normalisation, each
    an exp and a multiply. Normalised weights then move by at most 2 rho / (1 - rho) in total,
    the sums of n weighted values and of n weights add gamma_n each, the division u."""
    n = len(scores_abs)
    rho = gamma(head_dim + 1) * float(np.max(scores_abs)) + (n + 3) * (EXP_ERR + U)
    return (2 * rho / (1 - rho) + 2 * gamma(n) + 2 * U) * float(np.max(np.abs(v)))


def attention64(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    layer: int,
    seq_idx: np.ndarray,
    positions: np.ndarray,
    tables: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(out [T,Hq,hd] in float64, bound [T,Hq]) of causal paged attention: token t of sequence s at
    position p attends to its sequence's positions 0..p, read from the logical caches
    [L, NB, bs, Hk, hd] through the block table (this step's keys already written there).
    Padding tokens (seq -1) get 0 and bound 0."""
    T, Hq, hd = q.shape
    bs, Hk = k_cache.shape[2], k_cache.shape[3]
    G = Hq // Hk
    out = np.zeros((T, Hq, hd))
    bound = np.zeros((T, Hq))
    for t in range(T):
        s, p = int(seq_idx[t]), int(positions[t])
        if s < 0:
            continue
        slots = [(tables[s, j // bs], j % bs) for j in range(p + 1)]
        k = np.stack([k_cache[layer, b, o] for b, o in slots]).astype(np.float64)  # [P, Hk, hd]
        v = np.stack([v_cache[layer, b, o] for b, o in slots]).astype(np.float64)
        for h in range(Hq):
            qh = q[t, h].astype(np.float64)
            sc = k[:, h // G] @ qh / np.sqrt(hd)
            w = np.exp(sc - sc.max())
            out[t, h] = (w / w.sum()) @ v[:, h // G]
            bound[t, h] = softmax_bound(np.abs(k[:, h // G]) @ np.abs(qh) / np.sqrt(hd), v[:, h // G], hd)
    return out, bound


def local64(qg: np.ndarray, k: np.ndarray, v: np.ndarray, seq_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(out [T,Hk,G,hd] float64, bound [T,Hk,G]) of attention over this step's own keys only: token
    t sees the tokens of its run (same seq_idx, contiguous) up to itself; qg already scaled by
    1/sqrt(hd) (the bound counts that rounding as the kernel's own)."""
    T, Hk, G, hd = qg.shape
    out = np.zeros((T, Hk, G, hd))
    bound = np.zeros((T, Hk, G))
    lo = 0
    for t in range(T):
        if seq_idx[t] < 0:
            continue
        if t == 0 or seq_idx[t] != seq_idx[t - 1]:
            lo = t
        kk, vv = k[lo : t + 1].astype(np.float64), v[lo : t + 1].astype(np.float64)
        for h in range(Hk):
            for g in range(G):
                qh = qg[t, h, g].astype(np.float64)
                sc = kk[:, h] @ qh
                w = np.exp(sc - sc.max())
                out[t, h, g] = (w / w.sum()) @ vv[:, h]
                bound[t, h, g] = softmax_bound(np.abs(kk[:, h]) @ np.abs(qh), vv[:, h], hd)
    return out, bound
