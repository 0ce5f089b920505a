"""Which ggml type each tensor of a synthetic GGUF gets: llama.cpp's choices for a file type.

Owns: `Mix` (a file format bench synth writes: llama.cpp's file type, its default tensor type),
`MIXES` by name (f16, q8_0, q4_0, q4_1, q4_k_m, q5_k_m, q6_k), `tensor_type` (one tensor's
type) and `tensor_bytes`.
The rule is llama.cpp's src/llama-quant.cpp for these file types (learnt from it, not
translated): vectors, norms and the MoE router stay F32; an F16 file is every other matrix F16
(convert_hf_to_gguf.py's output, which llama-quantize starts from); otherwise a matrix takes the
mix's default type, except
- the output matrix, and the token embedding where it is tied to the output (no
  output.weight), takes Q6_K (Q8_0 in a Q8_0 file, or where its rows are not whole blocks of the
  default type);
- in Q4_K_M and Q5_K_M, attn_v and ffn_down (ffn_down_exps) take Q6_K in the layers
  `use_more_bits` picks: the first and last eighth, and every third layer between;
- a K-quant a row is not whole super-blocks of (Gemma 3 1B's 1152 columns) falls back to
  Q5_0 (from Q4_K), Q5_1 (Q5_K) or Q8_0 (Q6_K).
The rules llama.cpp keeps for other file types, 70B models and 8-expert MoE are left out: no
shape here has them.
Must not quantize or write files. Tested by tests/bench/test_synth.py, against the types of the
shipped Q4_K_M Gemma 3 270M and Q4_1 SmolLM2 files as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf

from bench.synth_layout import TensorSpec

Q = gguf.GGMLQuantizationType
FT = gguf.LlamaFileType


@dataclass(frozen=True, slots=True)
class Mix:
    """A file format: `file_type` is general.file_type (llama.cpp's llama_ftype), `default` the
    type most matrices take, `more_bits` whether attn_v / ffn_down get Q6_K in some layers (the
    _M mixes), `llama_quantize` the name llama-quantize takes for it."""

    name: str
    file_type: int
    default: Q
    more_bits: bool = False

    @property
    def llama_quantize(self) -> str:
        return self.name.upper()


MIXES = {
    m.name: m
    for m in (
        Mix("f16", FT.MOSTLY_F16, Q.F16),
        Mix("q8_0", FT.MOSTLY_Q8_0, Q.Q8_0),
        Mix("q4_0", FT.MOSTLY_Q4_0, Q.Q4_0),
        Mix("q4_1", FT.MOSTLY_Q4_1, Q.Q4_1),
        Mix("q4_k_m", FT.MOSTLY_Q4_K_M, Q.Q4_K, more_bits=True),
        Mix("q5_k_m", FT.MOSTLY_Q5_K_M, Q.Q5_K, more_bits=True),
        Mix("q6_k", FT.MOSTLY_Q6_K, Q.Q6_K),
    )
}
K_MIXES = tuple(name for name, m in MIXES.items() if m.default in (Q.Q4_K, Q.Q5_K, Q.Q6_K))
_MORE_BITS_KINDS = ("attn_v", "ffn_down", "ffn_down_exps")
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's pick of the layers a _M mix gives more bits: the first and last eighth, and
    every third layer between."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def block_size(t: Q) -> int:
    return gguf.GGML_QUANT_SIZES[t][0]


def tensor_type(mix: Mix, spec: TensorSpec, num_layers: int, tied: bool) -> Q:
    """The type of `spec` in a `mix` file of `num_layers` blocks; `tied`: the file has no
    output.weight (the token embedding is the output matrix)."""
    if len(spec.shape) < 2 or spec.kind.endswith("_norm") or spec.kind == "ffn_gate_inp":
        return Q.F32
    if mix.default == Q.F16:
        return Q.F16
    t, cols = mix.default, spec.shape[-1]
    if spec.kind == "output" or (tied and spec.kind == "token_embd"):
        t = Q.Q8_0 if cols % block_size(t) or t == Q.Q8_0 else Q.Q6_K
    elif spec.kind in _MORE_BITS_KINDS and mix.more_bits and use_more_bits(spec.layer, num_layers):
        t = Q.Q6_K
    if cols % block_size(t):
        t = _FALLBACK[t]
    return t


def tensor_bytes(spec: TensorSpec, t: Q) -> int:
    block, nbytes = gguf.GGML_QUANT_SIZES[t]
    return spec.num_values // block * nbytes
