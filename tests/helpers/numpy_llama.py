"""An independent plain-numpy Llama forward over Hugging Face named [out, in] tensors (shares no
code with tl/): RMSNorm, RoPE (half-split), attention and the SwiGLU MLP in float64, for the model
tests (tests/model/test_llama_reference.py) and the runtime's (tests/runtime/test_decode_steps.py).
Must hold no tests."""

from __future__ import annotations

import numpy as np

from tl.model.config import ModelConfig


def np_rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w


def np_rope(x: np.ndarray, theta: float) -> np.ndarray:
    """x [T,H,hd]; pairs dimension i with i + hd/2 (Hugging Face rotate-half)."""
    T, _, hd = x.shape
    freqs = theta ** (-np.arange(hd // 2) * 2.0 / hd)
    ang = np.arange(T)[:, None] * freqs[None, :]  # [T, hd/2]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def np_forward(t: dict[str, np.ndarray], cfg: ModelConfig, ids: list[int]) -> np.ndarray:
    g = {k: v.astype(np.float64) for k, v in t.items()}
    T, H, Hk, hd = len(ids), cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x = g["model.embed_tokens.weight"][ids]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        h = np_rmsnorm(x, g[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        proj = {}
        for n in "qkv":
            y = h @ g[p + f"self_attn.{n}_proj.weight"].T
            if cfg.attention_bias:
                y = y + g[p + f"self_attn.{n}_proj.bias"]
            proj[n] = y.reshape(T, -1, hd)
        q, k, v = np_rope(proj["q"], cfg.rope_theta), np_rope(proj["k"], cfg.rope_theta), proj["v"]
        out = np.zeros((T, H, hd))
        for head in range(H):
            kvh = head // (H // Hk)
            scores = q[:, head] @ k[:, kvh].T / np.sqrt(hd)
            scores[np.triu_indices(T, 1)] = -np.inf
            w = np.exp(scores - scores.max(-1, keepdims=True))
            out[:, head] = (w / w.sum(-1, keepdims=True)) @ v[:, kvh]
        x = x + out.reshape(T, H * hd) @ g[p + "self_attn.o_proj.weight"].T
        h = np_rmsnorm(x, g[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate, up = h @ g[p + "mlp.gate_proj.weight"].T, h @ g[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ g[p + "mlp.down_proj.weight"].T
    x = np_rmsnorm(x, g["model.norm.weight"], cfg.rms_norm_eps)
    head = g["model.embed_tokens.weight"] if cfg.tie_word_embeddings else g["lm_head.weight"]
    return x @ head.T
