"""A shape's GGUF as llama.cpp lays it out: its tensors (names, shapes, fills) and metadata keys.

Owns: `TensorSpec` (one tensor: llama.cpp's name, its numpy-order shape, how it is filled),
`tensor_specs` (every tensor of a Shape, in file order, for architectures llama, qwen3,
qwen3moe and gemma3, as llama.cpp's convert_hf_to_gguf.py names and shapes them) and
`metadata` (the `general.*` and `{arch}.*` keys llama.cpp's loader for that architecture reads,
and tl's tl/model/gguf_model.py with it).
Conventions kept: norms are stored as the multiplier itself (Gemma's 1 + w too), so every norm
is ones; Llama 3's RoPE scaling is the `rope_freqs.weight` tensor of per-frequency divisors, as
the converter writes it; Gemma 3's sliding layers are implied by `attention.sliding_window` (every
sixth layer full, llama.cpp's pattern). q/k rows are random, so llama's q/k permutation has
nothing to undo.
Must not write files or quantize. Tested by tests/bench/test_synth.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf

from bench.synth_shapes import Shape

FILLS = ("normal", "ones", "rope_freqs")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor: `shape` in numpy order (GGUF's dimensions reversed: [out, in], experts
    [experts, out, in], vectors [n]); `fill` one of FILLS; `layer` its block (-1 outside)."""

    name: str
    shape: tuple[int, ...]
    fill: str
    layer: int = -1

    @property
    def kind(self) -> str:
        """llama.cpp's tensor kind: the name without "blk.N." and ".weight" ("attn_v", "output")."""
        stem = self.name.removesuffix(".weight")
        return stem.split(".", 2)[2] if stem.startswith("blk.") else stem

    @property
    def num_values(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def tensor_specs(shape: Shape, num_layers: int) -> tuple[TensorSpec, ...]:
    """Every tensor of `shape` with `num_layers` blocks, in the order the file stores them."""
    h, v = shape.hidden_size, shape.vocab_size
    out = [TensorSpec("token_embd.weight", (v, h), "normal")]
    if shape.arch == "llama" and shape.rope_scaling is not None:
        out.append(TensorSpec("rope_freqs.weight", (shape.head_dim // 2,), "rope_freqs"))
    for i in range(num_layers):
        out += _layer(shape, i)
    out.append(TensorSpec("output_norm.weight", (h,), "ones"))
    if not shape.tie_word_embeddings:
        out.append(TensorSpec("output.weight", (v, h), "normal"))
    return tuple(out)


def _layer(shape: Shape, i: int) -> list[TensorSpec]:
    h, hd = shape.hidden_size, shape.head_dim
    q, kv = shape.num_heads * hd, shape.num_kv_heads * hd
    mats = {"attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q)}
    norms = {"attn_norm": h}
    if shape.arch in ("qwen3", "qwen3moe", "gemma3"):
        norms |= {"attn_q_norm": hd, "attn_k_norm": hd}
    if shape.arch == "gemma3":  # four norms a layer; ffn_norm is the MLP's pre-norm
        norms |= {"post_attention_norm": h, "ffn_norm": h, "post_ffw_norm": h}
    else:
        norms |= {"ffn_norm": h}
    if shape.num_experts:
        e, f = shape.num_experts, shape.moe_intermediate_size
        mats |= {"ffn_gate_inp": (e, h), "ffn_gate_exps": (e, f, h), "ffn_up_exps": (e, f, h)}
        mats |= {"ffn_down_exps": (e, h, f)}
    else:
        f = shape.intermediate_size
        mats |= {"ffn_gate": (f, h), "ffn_up": (f, h), "ffn_down": (h, f)}
    specs = [TensorSpec(f"blk.{i}.{k}.weight", (n,), "ones", i) for k, n in norms.items()]
    return specs + [TensorSpec(f"blk.{i}.{k}.weight", s, "normal", i) for k, s in mats.items()]


def metadata(shape: Shape, num_layers: int, file_type: int) -> dict[str, object]:
    """The model's metadata keys (ints written UINT32, floats FLOAT32, strings STRING), the
    tokenizer's excepted: `general.*` and what llama.cpp's loader for `shape.arch` reads."""
    a = shape.arch
    m: dict[str, object] = {
        "general.name": f"synth {shape.name} (random weights, shape of {shape.source})",
        "general.file_type": file_type,
        "general.quantization_version": gguf.GGML_QUANT_VERSION,
        f"{a}.vocab_size": shape.vocab_size,
        f"{a}.context_length": shape.context_length,
        f"{a}.embedding_length": shape.hidden_size,
        f"{a}.block_count": num_layers,
        f"{a}.feed_forward_length": shape.intermediate_size,
        f"{a}.attention.head_count": shape.num_heads,
        f"{a}.attention.head_count_kv": shape.num_kv_heads,
        f"{a}.attention.key_length": shape.head_dim,
        f"{a}.attention.value_length": shape.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": shape.rms_norm_eps,
        f"{a}.rope.freq_base": shape.rope_theta,
    }
    if a == "llama":
        m[f"{a}.rope.dimension_count"] = shape.head_dim
    if shape.rope_scaling is not None and shape.rope_scaling.rope_type == "linear":
        m |= {f"{a}.rope.scaling.type": "linear", f"{a}.rope.scaling.factor": shape.rope_scaling.factor}
    if shape.sliding_window:
        m[f"{a}.attention.sliding_window"] = shape.sliding_window
    if shape.num_experts:
        m |= {
            f"{a}.expert_count": shape.num_experts,
            f"{a}.expert_used_count": shape.num_experts_per_tok,
            f"{a}.expert_feed_forward_length": shape.moe_intermediate_size,
        }
    return m
