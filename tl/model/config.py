"""ModelConfig: the architecture read from a Hugging Face `config.json`.

Owns: parsing and validating config.json for the families tl serves (Llama 1-3 with
llama3/linear RoPE scaling, which covers SmolLM2; Mistral with its sliding window; Qwen2 with
q/k/v biases; Qwen3 with q/k norms; Qwen3-MoE; Gemma 3 text: (1 + w) norms, four per layer,
scaled embeddings, GeGLU, sliding layers with their own RoPE base), each family a set of
flags on one `ModelConfig` that the one forward (tl/model/llama.py) reads, and the shape of every Hugging Face
tensor a config implies (`hf_shapes`, described once). Errors name the file and the key.
Must not import jax. Tested by tests/model/test_model_files.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma3ForCausalLM",
)
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma3ForCausalLM": "gemma3_text",
}
ROPE_SCALING_TYPES = ("llama3", "linear")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
FULL, SLIDING = "full_attention", "sliding_attention"


class ModelDirError(ValueError):
    """A model directory file is missing or malformed; the message names the file."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling of the (global) layers: "linear" (positions / factor) or "llama3"
    (Llama 3.1's: long wavelengths / factor, short ones kept, a smooth blend between)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            d |= {
                "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
            }
        return d


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry biases (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: RopeScaling | None = None  # the global layers' (sliding layers use plain RoPE)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # RMSNorm multiplies by (norm_offset + weight): Gemma's 1
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), in their dtype (Gemma)
    hidden_act: str = "silu"  # the gated MLP's activation: SwiGLU or Gemma's tanh GeGLU
    sandwich_norms: bool = False  # Gemma: norms on the attention and MLP outputs too (4 per layer)
    query_scale: float = 0.0  # the attention's softmax scale; 0: head_dim**-0.5
    sliding_window: int = 0  # keys a sliding layer's query sees (itself included); 0: none
    layer_types: tuple[str, ...] = ()  # per layer FULL or SLIDING; (): every layer FULL
    rope_local_theta: float = 0.0  # the sliding layers' RoPE base (Gemma 3); 0: rope_theta
    num_experts: int = 0  # mixture of experts (Qwen3-MoE); 0: dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the chosen experts' router weights renormalized to sum 1
    decoder_sparse_step: int = 1  # every this-many-th layer is a MoE layer ...
    mlp_only_layers: tuple[int, ...] = ()  # ... except these, dense

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING and self.sliding_window > 0

    def window(self, layer: int) -> int:
        """The layer's attention window (0: full causal)."""
        return self.sliding_window if self.is_sliding(layer) else 0

    @property
    def attention_window(self) -> int:
        """W when every layer attends to its last W positions only (KV behind it is dead), else 0."""
        n = self.num_hidden_layers
        return self.sliding_window if n and all(self.is_sliding(i) for i in range(n)) else 0

    def layer_rope(self, layer: int) -> tuple[float, RopeScaling | None]:
        """(RoPE base, scaling) of the layer: Gemma 3's sliding layers have their own, unscaled."""
        if self.is_sliding(layer) and self.rope_local_theta:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    def is_moe(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % max(self.decoder_sparse_step, 1) == 0
        )

    @property
    def attn_scale(self) -> float:
        return self.query_scale or self.head_dim**-0.5

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = d.get("architectures") or []
        arch = archs[0] if isinstance(archs, list) and archs else d.get("model_type", "")
        by_type = {t: a for a, t in MODEL_TYPES.items()}
        arch = by_type.get(arch, arch)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelDirError(
                f"{source}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        gemma = arch == "Gemma3ForCausalLM"

        def need(key: str, kind: type) -> Any:
            if key not in d:
                raise ModelDirError(f"{source}: missing required key {key!r}")
            v = d[key]
            if kind is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
                raise ModelDirError(f"{source}: key {key!r} must be {kind.__name__}, got {v!r}")
            if kind in (int, float) and isinstance(v, int | float) and v <= 0:
                raise ModelDirError(f"{source}: key {key!r} must be positive, got {v!r}")
            return v

        hidden = need("hidden_size", int)
        heads = need("num_attention_heads", int)
        layers = need("num_hidden_layers", int)
        kv_heads = d.get("num_key_value_heads", heads)
        if not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads:
            raise ModelDirError(f"{source}: num_key_value_heads {kv_heads!r} must divide num_attention_heads {heads}")
        head_dim = d.get("head_dim") or hidden // heads
        if not isinstance(head_dim, int) or head_dim % 2:
            raise ModelDirError(f"{source}: head_dim {head_dim!r} must be an even integer")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (eos,) if isinstance(eos, int) else ()
        act = d.get("hidden_activation") or d.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
        if act not in ACTIVATIONS:
            raise ModelDirError(f"{source}: activation {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if d.get(key) is not None:
                raise ModelDirError(f"{source}: {key} {d[key]!r} is not supported")
        if d.get("use_sliding_window") and arch.startswith("Qwen"):
            raise ModelDirError(f"{source}: use_sliding_window (with max_window_layers) is not supported")
        theta, local_theta, scaling = _rope(d, source, gemma)
        window = d.get("sliding_window") or 0
        if not isinstance(window, int) or window < 0:
            raise ModelDirError(f"{source}: key 'sliding_window' must be a positive integer or null, got {window!r}")
        layer_types = _layer_types(d, source, layers, arch, window)
        num_experts = int(d.get("num_experts") or 0) if arch == "Qwen3MoeForCausalLM" else 0
        qpas = d.get("query_pre_attn_scalar")
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size", int),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size", int),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=theta,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
            attention_bias=bool(d.get("attention_bias", arch == "Qwen2ForCausalLM")),
            bos_token_id=d.get("bos_token_id") if isinstance(d.get("bos_token_id"), int) else None,
            eos_token_ids=eos_ids,
            rope_scaling=scaling,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") or gemma,
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=gemma,
            hidden_act=act,
            sandwich_norms=gemma,
            query_scale=float(qpas) ** -0.5 if gemma and qpas else 0.0,
            sliding_window=window if any(t == SLIDING for t in layer_types) else 0,
            layer_types=layer_types,
            rope_local_theta=local_theta,
            num_experts=num_experts,
            num_experts_per_tok=int(d.get("num_experts_per_tok") or 0) if num_experts else 0,
            moe_intermediate_size=int(d.get("moe_intermediate_size") or 0) if num_experts else 0,
            norm_topk_prob=bool(d.get("norm_topk_prob", False)) if num_experts else False,
            decoder_sparse_step=int(d.get("decoder_sparse_step") or 1) if num_experts else 1,
            mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()) if num_experts else (),
        )

    def to_dict(self) -> dict[str, Any]:
        """The config.json form (what convert-gguf and the test-model builders write), in the
        keys transformers reads for the architecture."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": MODEL_TYPES[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": self.hidden_act,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "torch_dtype": "float32",
        }
        if self.rope_scaling is not None:
            d["rope_scaling"] = self.rope_scaling.to_dict()
        if self.architecture == "Gemma3ForCausalLM":
            d |= {
                "hidden_activation": self.hidden_act,
                "query_pre_attn_scalar": _number(self.attn_scale**-2),
                "rope_local_base_freq": self.rope_local_theta or self.rope_theta,
                "sliding_window": self.sliding_window or None,
                "layer_types": list(self.layer_types) or [FULL] * self.num_hidden_layers,
                "final_logit_softcapping": None,
                "attn_logit_softcapping": None,
            }
        elif self.architecture == "MistralForCausalLM":
            d["sliding_window"] = self.sliding_window or None
        if self.num_experts:
            d |= {
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": self.decoder_sparse_step,
                "mlp_only_layers": list(self.mlp_only_layers),
            }
        return d


def _number(x: float) -> float | int:
    """x as the int it is within rounding (transformers' Gemma 3 config requires an int)."""
    return round(x) if abs(x - round(x)) < 1e-6 * max(1.0, abs(x)) else x


def _rope(d: dict[str, Any], source: str, gemma: bool) -> tuple[float, float, RopeScaling | None]:
    """(rope_theta, the sliding layers' base (0: the same), scaling) from either config form:
    rope_theta / rope_local_base_freq / rope_scaling (as the Hub's files have them), or
    transformers 5's rope_parameters (one dict, or one per layer type)."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and FULL in params:
        full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
    elif isinstance(params, dict):
        full, local = params, {}
    else:
        full, local = dict(d.get("rope_scaling") or {}), {}
        full.setdefault("rope_theta", d.get("rope_theta", 10000.0))
        if gemma:
            local = {"rope_theta": d.get("rope_local_base_freq", 10000.0)}
    theta = float(full.get("rope_theta", d.get("rope_theta", 10000.0)))
    local_theta = float(local.get("rope_theta", 0.0))
    if local.get("rope_type", "default") not in ("default", None):
        raise ModelDirError(f"{source}: sliding layers' rope_type {local['rope_type']!r} is not supported")
    kind = full.get("rope_type", full.get("type"))
    if kind in ("default", None):
        return theta, local_theta, None
    if kind not in ROPE_SCALING_TYPES:
        raise ModelDirError(
            f"{source}: rope scaling type {kind!r} is not supported (supported: {', '.join(ROPE_SCALING_TYPES)})"
        )
    try:
        factor = float(full["factor"])
        if kind == "linear":
            return theta, local_theta, RopeScaling("linear", factor)
        return (
            theta,
            local_theta,
            RopeScaling(
                "llama3",
                factor,
                float(full["low_freq_factor"]),
                float(full["high_freq_factor"]),
                int(full["original_max_position_embeddings"]),
            ),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelDirError(f"{source}: rope scaling {full!r} lacks or mistypes {e}") from None


def _layer_types(d: dict[str, Any], source: str, layers: int, arch: str, window: int) -> tuple[str, ...]:
    """Each layer's attention: `layer_types` where given, else Gemma 3's pattern (every
    `sliding_window_pattern`-th layer full, the rest sliding), else Mistral's (all sliding
    when sliding_window is set); () when every layer is full."""
    types = d.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or any(t not in (FULL, SLIDING) for t in types):
            raise ModelDirError(
                f"{source}: key 'layer_types' must list {layers} of {FULL!r} / {SLIDING!r}, got {types!r}"
            )
        out = tuple(types)
    elif arch == "Gemma3ForCausalLM":
        pattern = int(d.get("sliding_window_pattern", 6))
        out = tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers))
    elif arch == "MistralForCausalLM" and window:
        out = (SLIDING,) * layers
    else:
        return ()
    if SLIDING in out and not window:
        raise ModelDirError(f"{source}: layer_types has sliding layers but no 'sliding_window'")
    return out if SLIDING in out else ()


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor the model needs, in one fixed order (random
    test weights are drawn in it): the one description that loading (tl/model/loader.py) and the
    checks of a model directory (tl/model/files.py) read."""
    d, f, v, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.q_size, cfg.kv_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
        }
        if cfg.is_moe(i):
            fe = cfg.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (cfg.num_experts, d)
            for e in range(cfg.num_experts):
                x = f"{p}mlp.experts.{e}."
                shapes |= {
                    x + "gate_proj.weight": (fe, d),
                    x + "up_proj.weight": (fe, d),
                    x + "down_proj.weight": (d, fe),
                }
        else:
            shapes |= {p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d)}
            shapes |= {p + "mlp.down_proj.weight": (d, f)}
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (cfg.head_dim,), p + "self_attn.k_norm.weight": (cfg.head_dim,)}
        if cfg.sandwich_norms:
            shapes |= {p + "pre_feedforward_layernorm.weight": (d,), p + "post_feedforward_layernorm.weight": (d,)}
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,)}
            shapes |= {p + "self_attn.v_proj.bias": (kv,)}
    return shapes


def read_json(path: Path, required: bool = True) -> dict[str, Any]:
    """A JSON object file; {} when absent and not required. Errors name the file."""
    if not path.is_file():
        if required:
            raise ModelDirError(f"{path}: file not found")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelDirError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelDirError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def load_model_config(model_dir: str | Path) -> ModelConfig:
    if not Path(model_dir).is_dir():
        raise ModelDirError(f"model directory {str(model_dir)!r} does not exist")
    path = Path(model_dir) / "config.json"
    return ModelConfig.from_dict(read_json(path), source=str(path))
