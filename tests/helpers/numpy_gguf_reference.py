"""An independent plain-numpy Llama forward that reads a GGUF file directly.

Owns nothing of tl: it shares no code with tl/ (not the converter, not the model, not the
tokenizer). It reads tensors with the `gguf` package, keeps llama.cpp's q/k row order and
applies RoPE the way llama.cpp does for that order (adjacent pairs, "interleaved"), so a
bug in tl's un-permutation or in its rotate-half RoPE shows up as a logit difference.
Used by tests/model/test_smollm2.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np


@dataclass
class GGUFModel:
    n_layer: int
    n_head: int
    n_kv: int
    eps: float
    theta: float
    w: dict[str, np.ndarray]

    @classmethod
    def load(cls, path: str) -> GGUFModel:
        r = gguf.GGUFReader(path)

        def field(name: str) -> float:
            return float(r.fields[name].contents())

        # float64 once here (exact): a float32 weight in a float64 product is widened on every call
        w = {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64) for t in r.tensors}
        return cls(
            n_layer=int(field("llama.block_count")),
            n_head=int(field("llama.attention.head_count")),
            n_kv=int(field("llama.attention.head_count_kv")),
            eps=field("llama.attention.layer_norm_rms_epsilon"),
            theta=field("llama.rope.freq_base"),
            w=w,
        )

    def logits(self, ids: list[int]) -> np.ndarray:
        """[T, V] float32 logits of a causal forward over `ids` (no cache)."""
        return self._forward(ids, [], last=False)

    def _forward(self, ids: list[int], cache: list[tuple[np.ndarray, np.ndarray]], last: bool) -> np.ndarray:
        """Logits of `ids` at the positions after the cached ones (float64 inside). `cache` holds
        each layer's rotated keys and values so far ([P, n_kv, hd]), extended in place (an empty
        list: nothing cached yet). last: the final position's logits only ([1, V])."""
        x = self.w["token_embd.weight"][np.asarray(ids)].astype(np.float64)
        T, D = x.shape
        hd = D // self.n_head
        past = cache[0][0].shape[0] if cache else 0
        for i in range(self.n_layer):
            p = f"blk.{i}."
            h = _rms(x, self.w[p + "attn_norm.weight"], self.eps)
            q = (h @ self.w[p + "attn_q.weight"].T).reshape(T, self.n_head, hd)
            k = (h @ self.w[p + "attn_k.weight"].T).reshape(T, self.n_kv, hd)
            v = (h @ self.w[p + "attn_v.weight"].T).reshape(T, self.n_kv, hd)
            q, k = _rope_adjacent(q, self.theta, past), _rope_adjacent(k, self.theta, past)
            if i < len(cache):
                k, v = np.concatenate([cache[i][0], k]), np.concatenate([cache[i][1], v])
                cache[i] = (k, v)
            else:
                cache.append((k, v))
            rep = self.n_head // self.n_kv
            k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
            s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
            causal = np.arange(past + T)[None, :] <= (past + np.arange(T))[:, None]
            s = np.where(causal[None], s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            a = np.einsum("hts,shd->thd", s / s.sum(-1, keepdims=True), v).reshape(T, D)
            x = x + a @ self.w[p + "attn_output.weight"].T
            h = _rms(x, self.w[p + "ffn_norm.weight"], self.eps)
            g = h @ self.w[p + "ffn_gate.weight"].T
            x = x + ((g / (1 + np.exp(-g))) * (h @ self.w[p + "ffn_up.weight"].T)) @ self.w[p + "ffn_down.weight"].T
        x = _rms(x[-1:] if last else x, self.w["output_norm.weight"], self.eps)
        head = self.w.get("output.weight", self.w["token_embd.weight"])
        return (x @ head.T).astype(np.float32)

    def greedy(self, ids: list[int], n: int) -> list[int]:
        """n greedy tokens after ids: the prompt once, then one token a step over the cached
        keys and values (the same arithmetic as `logits` over the whole sequence)."""
        cache: list[tuple[np.ndarray, np.ndarray]] = []
        out: list[int] = []
        feed = list(ids)
        for _ in range(n):
            out.append(int(np.argmax(self._forward(feed, cache, last=True)[-1])))
            feed = out[-1:]
        return out


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope_adjacent(x: np.ndarray, theta: float, start: int = 0) -> np.ndarray:
    """llama.cpp's normal RoPE: rotate each adjacent pair (2i, 2i+1) by pos * theta^(-2i/hd),
    positions start .. start + T - 1."""
    T, _, hd = x.shape
    inv = theta ** (-np.arange(0, hd, 2) / hd)
    ang = (start + np.arange(T))[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out
