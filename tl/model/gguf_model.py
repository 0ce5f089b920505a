"""A GGUF read as a Hugging Face model, and served as it is.

Owns: reading a llama.cpp GGUF file (architectures llama, with Llama 3's rope scaling;
qwen2; qwen3; qwen3moe; gemma3) into a ModelConfig built the way config.json is
(`gguf_model_config` writes the HF config keys and parses them with ModelConfig.from_dict, so a
GGUF and its HF directory agree); its tensors under HF names with llama.cpp's storage
conventions undone (`hf_name`, `to_hf`: llama's q/k row permutation, Gemma's norms stored as
1 + w, MoE experts stacked in one 3-D tensor), as float (`dequantize_tensor`) or as the file
stores them: `Packed`, the record of a tensor kept in a ggml block format, and
`packed_tensors` (every tensor under its HF name, block formats kept as the file's bytes, each
expert its own slice of the packed rows; a type tl does not serve refused naming the tensor,
its type and the types served: `served_types`, `check_served`). tl/model/files.py
`read_tensors` serves a model directory's GGUF through `packed_tensors`; writing a Hugging Face
directory from a GGUF is tl/model/convert_gguf.py's.
Must not import jax (the block formats' geometry, tl/model/encodings/ggml_formats.py, is
imported where it is used, as that module imports jax), must not import tl/model/files.py
(which imports this), and must not know the runner's parameter layout (HF names only).
Errors (not a GGUF, unsupported architecture or tensor type, a missing tensor) are GGUFError
naming the file. Tested by tests/model/test_convert_gguf.py, tests/model/test_gguf_families.py and
tests/model/test_gguf_file.py (small GGUFs written with gguf.GGUFWriter, plus the real SmolLM2 and
Gemma 3 files, slow).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tl.model.config import FULL, SLIDING, ModelConfig, ModelDirError, hf_shapes
from tl.model.gguf_file import GGUFFile, GGUFTensor
from tl.model.gguf_tokenizer import GGUFError

__all__ = [
    "GGUFError",
    "Packed",
    "check_served",
    "dequantize_tensor",
    "gguf_model_config",
    "open_gguf",
    "packed_tensors",
    "served_types",
    "to_hf",
]

Q = gguf.GGMLQuantizationType
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
GEMMA3_SWA_PATTERN = 6  # llama.cpp's gemma3 loader: every 6th layer full unless the file says otherwise
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's default for `{arch}.rope.freq_base_swa`
EXPERT = "{e}"  # stands for the expert index in the HF names of a stacked expert tensor

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": f"mlp.experts.{EXPERT}.gate_proj",
    "ffn_up_exps": f"mlp.experts.{EXPERT}.up_proj",
    "ffn_down_exps": f"mlp.experts.{EXPERT}.down_proj",
}
# Gemma 3 has four norms a layer: llama.cpp calls the HF post_attention_layernorm
# post_attention_norm, and the MLP's pre-norm ffn_norm (the name other families give
# post_attention_layernorm, which feeds their MLP).
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True, slots=True)
class Packed:
    """A tensor kept in a ggml block format: `data` uint8 [*rows, row_bytes], each row the
    blocks of its `n_in` values exactly as the GGUF stores them (a view of the mapped file where
    no rows were reordered). `format` names one of tl/model/encodings/ggml_formats.py FORMATS."""

    format: str
    data: np.ndarray
    n_in: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.data.shape[:-1], self.n_in)

    def with_rows(self, data: np.ndarray) -> Packed:
        """The same format over rows reordered or stacked (`data` [..., row_bytes])."""
        return Packed(self.format, data, self.n_in)

    def to_float(self) -> np.ndarray:
        """float32 [*rows, n_in] (gguf-py's dequantization)."""
        t = gguf.GGMLQuantizationType[self.format.upper()]
        flat = self.data.reshape(-1, self.data.shape[-1])
        return np.asarray(gguf.quants.dequantize(flat, t), np.float32).reshape(self.shape)


def served_types() -> tuple[str, ...]:
    """The GGUF tensor types a model can be served in as they are (F32 as float32; F16 and BF16
    matrices kept at 2 bytes a weight, vectors widened)."""
    from tl.model.encodings.ggml_formats import FORMATS

    return ("F32", *(f.upper() for f in FORMATS))


def packed_tensors(path: Path) -> dict[str, np.ndarray | Packed]:
    """Every tensor of the GGUF at `path` under its HF name, as the file stores it: block formats
    as `Packed` (views of the mapped file where no rows move; each expert of a stacked expert
    tensor its own slice), F16 and BF16 matrices too (their bytes, a "block" of one value),
    F32 as float32, F16 and BF16 vectors widened to float32; llama.cpp's
    conventions undone as `to_hf` does. A tensor type tl does not serve raises GGUFError naming
    the tensor, its type and the served types; a missing tensor, its GGUF name."""
    from tl.model.encodings.ggml_formats import HALVES, by_ggml_type

    reader = open_gguf(path)
    cfg = gguf_model_config(reader, path)
    out: dict[str, np.ndarray | Packed] = {}
    for t in reader.tensors:
        name = hf_name(t.name, cfg.architecture)
        if name is None:
            continue
        fmt = by_ggml_type(int(Q(t.tensor_type)))
        if fmt is not None and fmt.name in HALVES and len(t.shape) < 2:
            fmt = None  # a 16-bit vector (a norm, a bias): widened, as the layers read float vectors
        w: np.ndarray | Packed
        if fmt is not None:  # data: uint8 [*reversed(shape[1:]), row_bytes]
            rows = tuple(int(n) for n in reversed(t.shape[1:]))
            data = np.asarray(t.data).view(np.uint8)  # f16 tensors read as float16 values: their bytes
            w = Packed(fmt.name, data.reshape(*rows, data.shape[-1]), int(t.shape[0]))
        else:  # F32, and F16 / BF16 vectors, as float32; any other type refused there
            w = dequantize_tensor(t, path)
        out |= dict(to_hf(cfg, name, w, path))
    check_names(set(out), cfg, path)
    return out


def check_served(reader: GGUFFile, cfg: ModelConfig, path: Path) -> None:
    """GGUFError unless every tensor has a type tl serves and none the config needs is missing
    (what serving the GGUF as it is would find)."""
    for t in reader.tensors:
        if Q(t.tensor_type).name not in served_types():
            dequantize_tensor(t, path)  # raises, naming the tensor, its type and the served types
    check_names({n for t in reader.tensors for n in _expand(hf_name(t.name, cfg.architecture), cfg)}, cfg, path)


def open_gguf(path: Path) -> GGUFFile:
    if not path.is_file():
        raise GGUFError(f"{path}: file not found")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (bad magic)")
    try:
        return GGUFFile(path)
    except Exception as e:  # noqa: BLE001 (a damaged file raises ValueError, IndexError, struct.error, ...)
        raise GGUFError(f"{path}: malformed GGUF ({type(e).__name__}: {e})") from None


def _need(reader: GGUFFile, key: str, path: Path) -> Any:
    v = reader.field(key)
    if v is None:
        raise GGUFError(f"{path}: missing metadata key {key!r}")
    return v


def _f32_round(x: float) -> float:
    """Shortest decimal that is the same float32 (9.999999747e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def gguf_model_config(reader: GGUFFile, path: Path) -> ModelConfig:
    """The GGUF's architecture as a ModelConfig: its metadata written as the config.json keys
    (`gguf_config_dict`) and parsed as config.json is, errors naming the file."""
    try:
        return ModelConfig.from_dict(gguf_config_dict(reader, path), source=str(path))
    except ModelDirError as e:
        raise GGUFError(str(e)) from None


def gguf_config_dict(reader: GGUFFile, path: Path) -> dict[str, Any]:
    """config.json of the GGUF's model, from `{arch}.*` metadata as llama.cpp's loaders read it."""
    arch = reader.field("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    hidden = int(_need(reader, f"{arch}.embedding_length", path))
    heads = int(_need(reader, f"{arch}.attention.head_count", path))
    head_dim = int(reader.field(f"{arch}.attention.key_length", hidden // heads))
    rope_dims = reader.field(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise GGUFError(f"{path}: {arch}.rope.dimension_count {rope_dims} (partial RoPE) is not supported")
    tokens = reader.field("tokenizer.ggml.tokens")
    eos = [reader.field("tokenizer.ggml.eos_token_id"), reader.field("tokenizer.ggml.eot_token_id")]
    names = {t.name for t in reader.tensors}
    eos_ids = list(dict.fromkeys(int(e) for e in eos if e is not None))
    d: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": int(reader.field(f"{arch}.vocab_size", 0 if tokens is None else len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(reader.field(f"{arch}.feed_forward_length", 0)),
        "num_hidden_layers": int(_need(reader, f"{arch}.block_count", path)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(reader.field(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rope_theta": _f32_round(reader.field(f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": _f32_round(_need(reader, f"{arch}.attention.layer_norm_rms_epsilon", path)),
        "max_position_embeddings": int(reader.field(f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": reader.field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
    }
    scaling = _rope_scaling(reader, arch, d, path)
    if scaling:
        d["rope_scaling"] = scaling
    if arch == "gemma3":
        d |= _gemma3_keys(reader, d, path)
    if arch == "qwen3moe":
        d |= _qwen3moe_keys(reader, d, path)
    if not d["intermediate_size"]:
        raise GGUFError(f"{path}: missing metadata key '{arch}.feed_forward_length'")
    return d


def _gemma3_keys(reader: GGUFFile, d: dict[str, Any], path: Path) -> dict[str, Any]:
    """Gemma 3's config keys as llama.cpp's gemma3 loader derives them: sliding layers when
    `gemma3.attention.sliding_window` is set, every GEMMA3_SWA_PATTERN-th layer full (or the
    per-layer `sliding_window_pattern` array / the pattern it gives), their RoPE base
    `rope.freq_base_swa` (default 10000); the softmax scale head_dim**-0.5, except the 62-layer
    (27B) model's (hidden / heads)**-0.5."""
    layers, window = d["num_hidden_layers"], int(reader.field("gemma3.attention.sliding_window", 0))
    pattern = reader.field("gemma3.attention.sliding_window_pattern", GEMMA3_SWA_PATTERN)
    if not window:
        types = [FULL] * layers
    elif isinstance(pattern, list):
        if len(pattern) != layers:
            raise GGUFError(
                f"{path}: gemma3.attention.sliding_window_pattern lists {len(pattern)} layers, not {layers}"
            )
        types = [SLIDING if swa else FULL for swa in pattern]
    else:  # llama.cpp's set_swa_pattern(n): layer i slides when i % n < n - 1 (n == 0: all slide)
        n = int(pattern)
        types = [SLIDING if n == 0 or i % n < n - 1 else FULL for i in range(layers)]
    scalar = d["hidden_size"] // d["num_attention_heads"] if layers == 62 else d["head_dim"]
    return {
        "sliding_window": window or None,
        "layer_types": types,
        "rope_local_base_freq": _f32_round(reader.field("gemma3.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)),
        "query_pre_attn_scalar": scalar,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": reader.field("gemma3.final_logit_softcapping"),
        "attn_logit_softcapping": reader.field("gemma3.attn_logit_softcapping"),
    }


def _qwen3moe_keys(reader: GGUFFile, d: dict[str, Any], path: Path) -> dict[str, Any]:
    """Qwen3-MoE: every layer a MoE layer, top-k weights renormalized (llama.cpp's qwen3moe
    graph always normalizes them)."""
    moe_size = int(_need(reader, "qwen3moe.expert_feed_forward_length", path))
    return {
        "num_experts": int(_need(reader, "qwen3moe.expert_count", path)),
        "num_experts_per_tok": int(_need(reader, "qwen3moe.expert_used_count", path)),
        "moe_intermediate_size": moe_size,
        "intermediate_size": d["intermediate_size"] or moe_size,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _rope_scaling(reader: GGUFFile, arch: str, d: dict[str, Any], path: Path) -> dict[str, Any] | None:
    """The config's rope_scaling: `{arch}.rope.scaling.type` linear (factor), or Llama 3's
    scaling, which llama.cpp's converter writes as a `rope_freqs.weight` tensor of per-frequency
    divisors (`llama3_from_rope_freqs`); other scaling types are refused by ModelConfig."""
    kind = reader.field(f"{arch}.rope.scaling.type")
    factor = reader.field(f"{arch}.rope.scaling.factor", reader.field(f"{arch}.rope.scale_linear"))
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        if kind not in (None, "none") or factor not in (None, 1.0):
            raise GGUFError(
                f"{path}: tensor 'rope_freqs.weight' together with {arch}.rope.scaling "
                f"({kind!r}, factor {factor!r}) is not supported"
            )
        return llama3_from_rope_freqs(dequantize_tensor(freqs, path), d["rope_theta"], d["head_dim"], path)
    if kind == "none" or (kind is None and factor in (None, 1.0)):
        return None
    if factor is None:
        raise GGUFError(f"{path}: {arch}.rope.scaling.type {kind!r} without {arch}.rope.scaling.factor")
    return {"rope_type": kind or "linear", "factor": _f32_round(factor)}


def llama3_rope_factors(scaling: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as rope_freqs.weight for Llama 3's
    rope_scaling (float32 [head_dim // 2]): 1 for short wavelengths, `factor` for long, a smooth
    blend between."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    wavelen = 2 * np.pi / freqs
    lo, hi, ctx = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["original_max_position_embeddings"]
    smooth = (ctx / wavelen - lo) / (hi - lo)
    blend = 1 / ((1 - smooth) / scaling["factor"] + smooth)
    out = np.where(wavelen < ctx / hi, 1.0, np.where(wavelen > ctx / lo, scaling["factor"], blend))
    return out.astype(np.float32)


def llama3_from_rope_freqs(factors: np.ndarray, theta: float, head_dim: int, path: Path) -> dict[str, Any] | None:
    """Llama 3's rope_scaling from the rope_freqs divisors. Only the ratios of
    original_max_position_embeddings to the two freq factors show in them, so low_freq_factor is
    taken as 1 (Llama 3's) and the rest solved from the blended entries, or, with fewer than two,
    the first of a few usual values that rebuilds the tensor; refused, naming the tensor, unless
    the result rebuilds it (then the forward computes the same divisors)."""
    factors = np.asarray(factors, np.float64).reshape(-1)
    if len(factors) * 2 != head_dim:
        raise GGUFError(
            f"{path}: tensor 'rope_freqs.weight' has {len(factors)} entries, expected head_dim/2 = {head_dim // 2}"
        )
    if np.allclose(factors, 1.0):
        return None
    factor = float(np.float32(factors.max()))
    blended = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    candidates = [
        (hi, ctx) for ctx in (8192, 4096, 2048, 16384, 32768, 65536, 131072) for hi in (4.0, 2.0, 8.0, 3.0, 16.0)
    ]
    if blended.sum() >= 2:  # 1/r = (1 - s)/factor + s with s = ctx/wavelen/(hi - 1) - 1/(hi - 1)
        inv_wavelen = (1.0 / (theta ** (np.arange(0, head_dim, 2) / head_dim)) / (2 * np.pi))[blended]
        s = (1 / factors[blended] - 1 / factor) / (1 - 1 / factor)
        slope, icept = np.polyfit(inv_wavelen, s, 1)
        if icept < 0:
            hi = round(1 - 1 / icept, 4)
            candidates = [(hi, round(slope * (hi - 1)))]
    for hi, ctx in candidates:
        scaling = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": hi,
            "original_max_position_embeddings": int(ctx),
        }
        if np.allclose(llama3_rope_factors(scaling, theta, head_dim), factors, rtol=1e-4, atol=1e-6):
            return scaling
    raise GGUFError(
        f"{path}: tensor 'rope_freqs.weight' does not follow Llama 3's rope scaling for any "
        "low/high_freq_factor and original_max_position_embeddings, and tl serves no other "
        "per-frequency RoPE factors"
    )


def hf_name(gguf_name: str, architecture: str = "LlamaForCausalLM") -> str | None:
    """The HF tensor name of a GGUF tensor name (experts: with EXPERT for the expert index), or
    None for tensors HF does not store (rope_freqs)."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    names = _GEMMA3_LAYER_NAMES if architecture == "Gemma3ForCausalLM" else _LAYER_NAMES
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{kind}"
    return None


def gguf_name(hf: str, architecture: str = "LlamaForCausalLM") -> str:
    """The GGUF name of an HF tensor name (for messages; experts name their stacked tensor)."""
    for stem, name in _GLOBAL_NAMES.items():
        if hf.startswith(name + "."):
            return stem + hf[len(name) :]
    names = _GEMMA3_LAYER_NAMES if architecture == "Gemma3ForCausalLM" else _LAYER_NAMES
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(\w+)", re.sub(r"experts\.\d+\.", f"experts.{EXPERT}.", hf))
    by_hf = {v: k for k, v in names.items()}
    return f"blk.{m.group(1)}.{by_hf[m.group(2)]}.{m.group(3)}" if m and m.group(2) in by_hf else hf


def _expand(name: str | None, cfg: ModelConfig) -> list[str]:
    if name is None:
        return []
    return [name.replace(EXPERT, str(e)) for e in range(cfg.num_experts)] if EXPERT in name else [name]


def check_names(names: set[str], cfg: ModelConfig, path: Path) -> None:
    """GGUFError naming the GGUF tensor of the first HF tensor the config needs and `names` lacks."""
    for hf in hf_shapes(cfg):
        if hf not in names:
            raise GGUFError(f"{path}: tensor {gguf_name(hf, cfg.architecture)!r} is missing (HF {hf!r})")


def to_hf(cfg: ModelConfig, name: str, w: np.ndarray | Packed, path: Path) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor) pairs of one GGUF tensor already named `name` (hf_name) with llama.cpp's
    conventions undone: llama's q/k rows un-permuted; Gemma's norms, which llama.cpp stores as
    1 + w, back to HF's w (ModelConfig.norm_offset adds the 1); a stacked expert tensor
    [E, out, in] split per expert (Packed: a slice of the expert axis, each stays packed)."""
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    part = name.split(".")[-2]
    if cfg.architecture == "LlamaForCausalLM" and part in heads:
        w = w.with_rows(unpermute_qk(w.data, heads[part])) if isinstance(w, Packed) else unpermute_qk(w, heads[part])
    if cfg.norm_offset and name.endswith("norm.weight"):
        if isinstance(w, Packed):
            raise GGUFError(
                f"{path}: norm tensor {gguf_name(name, cfg.architecture)!r} is block-quantized ({w.format})"
            )
        w = w - np.float32(cfg.norm_offset)
    if EXPERT not in name:
        yield name, w
        return
    if w.shape[0] != cfg.num_experts:
        raise GGUFError(
            f"{path}: tensor {gguf_name(name, cfg.architecture)!r} stacks {w.shape[0]} experts, "
            f"expected {cfg.num_experts}"
        )
    for e in range(cfg.num_experts):
        yield name.replace(EXPERT, str(e)), w.with_rows(w.data[e]) if isinstance(w, Packed) else w[e]


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's HF->GGUF q/k permutation: rows [n_head, 2, hd/2] -> [n_head, hd/2, 2]."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Exact inverse of permute_qk: rows [n_head, hd/2, 2] -> [n_head, 2, hd/2]."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(t: GGUFTensor, path: Path) -> np.ndarray:
    """float32 array in HF/numpy order ([out, in] for matrices)."""
    ttype = Q(t.tensor_type)
    if ttype.name not in served_types():
        raise GGUFError(
            f"{path}: tensor {t.name!r} has type {ttype.name}, which tl does not serve "
            f"(served: {', '.join(served_types())})"
        )
    shape = tuple(int(n) for n in reversed(t.shape))
    return np.ascontiguousarray(gguf.quants.dequantize(t.data, ttype), dtype=np.float32).reshape(shape)
