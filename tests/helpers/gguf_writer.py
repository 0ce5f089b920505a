"""Writing GGUF files for tests, independently of tl's reader: llama.cpp's tensor names, the
byte vocabulary's metadata, write_gguf, family_gguf (a tiny model of each family as llama.cpp
would convert it) and write_model_gguf (mixed block kinds, CASES). The K-quants' numpy
quantizers (Q4_K, Q6_K) are bench/kquants.py's, which `python -m bench synth` writes with too.
Must hold no tests."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf.quants import quantize

from bench.kquants import quantize_q4_k, quantize_q6_k
from tests.helpers.models import SPECIAL_TOKENS, TINY, tiny_config
from tl.model.config import ModelConfig
from tl.model.gguf_model import permute_qk
from tl.text.tokenizer import byte_level_alphabet

Q = gguf.GGMLQuantizationType


def write_gguf(
    path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Q]], metadata: dict[str, object] | None = None
) -> Path:
    w = gguf.GGUFWriter(str(path), arch=arch)
    for key, value in (metadata or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)  # type: ignore[arg-type]
    for name, (x, qtype) in tensors.items():
        data = quantized_bytes(x, qtype)
        w.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def to_gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def byte_vocab_metadata() -> dict[str, object]:
    tokens = [*byte_level_alphabet(), *SPECIAL_TOKENS]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 256 + [3] * len(SPECIAL_TOKENS),
        "tokenizer.ggml.bos_token_id": 257,
        "tokenizer.ggml.eos_token_id": 258,
        "tokenizer.chat_template": "{{ messages[0]['content'] }}",
    }


# llama.cpp's tensor names (gguf-py's tensor_mapping), HF module -> GGUF, per family.
GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


LAYER = {
    **LAYER_NAMES,  # Llama 2's (LAYER_NAMES above), then the new families'
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
}


GEMMA3_LAYER = {
    **LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def llama_cpp_tensors(cfg: ModelConfig, hf: dict[str, np.ndarray], arch: str) -> dict[str, np.ndarray]:
    """What llama.cpp's converter stores for `hf`: GGUF names, llama's q/k rows permuted, Gemma's
    norms + 1, each layer's experts stacked [E, out, in]."""
    layer_names = GEMMA3_LAYER if arch == "gemma3" else LAYER
    out: dict[str, np.ndarray] = {}
    experts: dict[str, list[np.ndarray]] = {}
    for name, x in hf.items():
        module, kind = name.rsplit(".", 1)
        if arch == "gemma3" and name.endswith("norm.weight"):
            x = x + np.float32(1.0)
        if arch == "llama" and module.endswith(("q_proj", "k_proj")):
            x = permute_qk(x, cfg.num_attention_heads if "q_proj" in module else cfg.num_key_value_heads)
        if module in GLOBAL:
            out[f"{GLOBAL[module]}.{kind}"] = x
            continue
        _, _, layer, rest = module.split(".", 3)
        if rest.startswith("mlp.experts."):
            experts.setdefault(f"blk.{layer}.{EXPERTS[rest.split('.')[-1]]}.{kind}", []).append(x)
        else:
            out[f"blk.{layer}.{layer_names[rest]}.{kind}"] = x
    return out | {name: np.stack(xs) for name, xs in experts.items()}


def llama3_rope_freqs(theta: float, dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """llama.cpp's LlamaModel.generate_extra_tensors, element by element."""
    factors = []
    low_wavelen = scaling["original_max_position_embeddings"] / scaling["low_freq_factor"]
    high_wavelen = scaling["original_max_position_embeddings"] / scaling["high_freq_factor"]
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi / (1.0 / theta ** (i / dim))
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(scaling["factor"])
        else:
            smooth = (scaling["original_max_position_embeddings"] / wavelen - scaling["low_freq_factor"]) / (
                scaling["high_freq_factor"] - scaling["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / scaling["factor"] + smooth))
    return np.array(factors, np.float32)


def family_gguf(
    path: Path,
    cfg: ModelConfig,
    hf: dict[str, np.ndarray],
    arch: str,
    qtype: Q = Q.F32,
    meta: dict[str, object] | None = None,
    drop: tuple[str, ...] = (),
    rope_freqs: np.ndarray | None = None,
) -> Path:
    tensors = {
        n: (x, qtype if x.ndim >= 2 else Q.F32) for n, x in llama_cpp_tensors(cfg, hf, arch).items() if n not in drop
    }
    m: dict[str, object] = {
        f"{arch}.block_count": cfg.num_hidden_layers,
        f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.attention.key_length": cfg.head_dim,
        f"{arch}.attention.value_length": cfg.head_dim,
        f"{arch}.rope.freq_base": cfg.rope_theta,
        f"{arch}.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        **byte_vocab_metadata(),
    }
    if arch == "qwen3moe":
        m |= {
            "qwen3moe.expert_count": cfg.num_experts,
            "qwen3moe.expert_used_count": cfg.num_experts_per_tok,
            "qwen3moe.expert_feed_forward_length": cfg.moe_intermediate_size,
        }
    if arch == "gemma3" and cfg.sliding_window:
        m["gemma3.attention.sliding_window"] = cfg.sliding_window
    if arch == "llama" and cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "llama3":
        freqs = llama3_rope_freqs(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling.to_dict())
        tensors["rope_freqs.weight"] = (freqs if rope_freqs is None else rope_freqs, Q.F32)
    return write_gguf(path, arch, tensors, m | (meta or {}))


# A mix as llama.cpp's Q4_K_M-style recipes make: per tensor kind its own format.
MIXED = {"attn_q": Q.Q4_0, "attn_k": Q.Q4_0, "attn_v": Q.Q8_0, "attn_output": Q.Q5_1, "ffn_gate": Q.Q4_1}
MIXED |= {"ffn_up": Q.Q5_0, "ffn_down": Q.Q8_0, "token_embd": Q.Q8_0, "output": Q.Q4_1}


def _packed(x: np.ndarray, t: Q) -> np.ndarray:
    if t == Q.Q2_K:  # no quantizer anywhere here: zero blocks (the type is what is tested)
        return np.zeros((x.shape[0], x.shape[1] // 256 * gguf.GGML_QUANT_SIZES[t][1]), np.uint8)
    if t == Q.Q4_K:
        return quantize_q4_k(x).reshape(x.shape[0], -1)
    if t == Q.Q6_K:
        return quantize_q6_k(x).reshape(x.shape[0], -1)
    return np.asarray(quantize(x, t))


def write_model_gguf(path: Path, cfg: ModelConfig, hf: dict[str, np.ndarray], types: dict[str, Q]) -> Path:
    """What llama.cpp's converter and quantizer write for these HF tensors (llama: q/k rows
    permuted), each matrix in types[its GGUF kind] (default Q8_0), vectors F32."""
    tensors: dict[str, tuple[np.ndarray, Q]] = {}
    for name, x in hf.items():
        if ".q_proj." in name:
            x = permute_qk(x, cfg.num_attention_heads)
        elif ".k_proj." in name:
            x = permute_qk(x, cfg.num_key_value_heads)
        g = to_gguf_name(name)
        kind = g.split(".")[-2] if g.startswith("blk.") else g.split(".")[0]
        tensors[g] = (x, types.get(kind, Q.Q8_0) if x.ndim == 2 else Q.F32)
    a = "llama"
    meta: dict[str, object] = {
        f"{a}.block_count": cfg.num_hidden_layers,
        f"{a}.context_length": cfg.max_position_embeddings,
        f"{a}.embedding_length": cfg.hidden_size,
        f"{a}.feed_forward_length": cfg.intermediate_size,
        f"{a}.attention.head_count": cfg.num_attention_heads,
        f"{a}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{a}.rope.freq_base": cfg.rope_theta,
        f"{a}.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        **byte_vocab_metadata(),
    }
    return _write(path, a, tensors, meta)


def _write(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Q]], meta: dict[str, object]) -> Path:
    w = gguf.GGUFWriter(str(path), arch=arch)
    for key, value in meta.items():
        if isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)  # type: ignore[arg-type]
    for name, (x, t) in tensors.items():
        w.add_tensor(name, x if t == Q.F32 else _packed(x, t), raw_dtype=None if t == Q.F32 else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _k_config() -> ModelConfig:
    """Widths that are multiples of 256, for the K-quants' super-blocks."""
    return dataclasses.replace(
        TINY,
        vocab_size=259,
        hidden_size=256,
        intermediate_size=512,
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=257,
        eos_token_ids=(258,),
    )


K_MIX = {k: Q.Q4_K for k in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")}
K_MIX |= {"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "token_embd": Q.Q4_K, "output": Q.Q6_K}


HALF_MIX = {k: Q.F16 for k in ("attn_q", "attn_k", "attn_v", "ffn_down", "output")}
HALF_MIX |= {k: Q.BF16 for k in ("attn_output", "ffn_gate", "ffn_up", "token_embd")}


CASES = {
    "q4_1": (lambda: tiny_config(tie=True), {k: Q.Q4_1 for k in MIXED} | {"token_embd": Q.Q8_0}),
    "mixed": (lambda: tiny_config(tie=False), MIXED),
    "k_quants": (_k_config, K_MIX),
    "halves": (lambda: tiny_config(tie=False), HALF_MIX),  # an F16 / BF16 file: 2 bytes a weight, as stored
}


def quantized_bytes(x: np.ndarray, qtype: Q) -> np.ndarray:
    """[rows, bytes_per_row] uint8 (or the float array itself for F32/F16)."""
    if qtype in (Q.F32, Q.F16):
        return x.astype(np.float32 if qtype == Q.F32 else np.float16)
    if qtype == Q.Q4_K:
        return quantize_q4_k(x).reshape(x.shape[0], -1)
    if qtype == Q.Q6_K:
        return quantize_q6_k(x).reshape(x.shape[0], -1)
    return gguf.quants.quantize(x, qtype)
