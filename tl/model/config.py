"""ModelConfig: the architecture read from a Hugging Face `config.json`.

Owns: parsing and validating config.json for the Llama family (LlamaForCausalLM, which
covers SmolLM2, and Qwen2ForCausalLM with q/k/v biases), and the shape of every Hugging Face
tensor a config implies (`hf_shapes`, described once). Errors name the file and the key.
Must not import jax. Tested by tests/test_model_files.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


class ModelDirError(ValueError):
    """A model directory file is missing or malformed; the message names the file."""


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

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = d.get("architectures") or []
        arch = archs[0] if isinstance(archs, list) and archs else d.get("model_type", "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelDirError(
                f"{source}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )

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
        kv_heads = d.get("num_key_value_heads", heads)
        if not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads:
            raise ModelDirError(f"{source}: num_key_value_heads {kv_heads!r} must divide num_attention_heads {heads}")
        head_dim = d.get("head_dim") or hidden // heads
        if not isinstance(head_dim, int) or head_dim % 2:
            raise ModelDirError(f"{source}: head_dim {head_dim!r} must be an even integer")
        if d.get("rope_scaling") not in (None, {}) and (d["rope_scaling"] or {}).get(
            "rope_type", d["rope_scaling"].get("type")
        ) not in ("default", None):
            raise ModelDirError(f"{source}: rope_scaling {d['rope_scaling']!r} is not supported")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (eos,) if isinstance(eos, int) else ()
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size", int),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size", int),
            num_hidden_layers=need("num_hidden_layers", int),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=float(d.get("rope_theta", 10000.0)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "Qwen2ForCausalLM")),
            bos_token_id=d.get("bos_token_id") if isinstance(d.get("bos_token_id"), int) else None,
            eos_token_ids=eos_ids,
        )

    def to_dict(self) -> dict[str, Any]:
        """The config.json form (what convert-gguf and the test-model builders write)."""
        return {
            "architectures": [self.architecture],
            "model_type": "qwen2" if self.architecture == "Qwen2ForCausalLM" else "llama",
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
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "torch_dtype": "float32",
        }


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor the model needs, in one fixed order (random
    test weights are drawn in it): the one description that loading (tl/model/llama.py) and the
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
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        }
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
