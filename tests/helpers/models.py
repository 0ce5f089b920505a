"""Test-model builders: tiny random-weight Llama/Qwen2 dirs and the "succ" bigram model.

Owns: writing complete Hugging Face style model directories (config.json,
model.safetensors or 2 shards + index, tokenizer.json, tokenizer_config.json,
generation_config.json) for tests. Must not import jax; uses only ModelConfig and
the byte-level alphabet of tl. Each builder runs in well under a second. Tested by
tests/model/test_model_files.py (the dirs load through tl.model.files and tl.text.tokenizer).

Byte tokenizer (both builders): a ByteLevel BPE whose vocab is the 256 byte-level
characters with id == byte value, no merges, plus specials
`<|endoftext|>`=256, `<|im_start|>`=257, `<|im_end|>`=258 (BYTE_VOCAB_SIZE = 259).
Every byte of the text is one token; special tokens written in the text are one token.

make_tiny_llama: bos `<|im_start|>` (257), eos `<|im_end|>` (258) in config.json,
tokenizer_config.json and generation_config.json; a ChatML chat template.

make_succ: after byte i the argmax next token is byte (i + 1) % 256 whatever the
context, with a logit margin of 16. After any special token the argmax is byte 65 'A'.
eos is `<|endoftext|>` (256), which is never the argmax. Chat template: the contents
concatenated, nothing else.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from tl.model.config import ModelConfig
from tl.text.tokenizer import byte_level_alphabet

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 256, 257, 258
BYTE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SUCC_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


def byte_tokenizer_json(specials: tuple[str, ...] = SPECIAL_TOKENS) -> dict[str, Any]:
    """tokenizer.json of the byte tokenizer: id == byte value, specials from 256 on."""
    vocab = {ch: b for b, ch in enumerate(byte_level_alphabet())}
    added = []
    for i, content in enumerate(specials):
        vocab[content] = 256 + i
        added.append(
            {
                "id": 256 + i,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False), encoding="utf-8")


def _write_weights(path: Path, tensors: dict[str, np.ndarray], sharded: bool) -> None:
    tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}
    if not sharded:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    half = len(names) // 2
    parts = [names[:half], names[half:]]
    weight_map = {}
    for n, part in enumerate(parts, start=1):
        fname = f"model-{n:05d}-of-{len(parts):05d}.safetensors"
        save_file({k: tensors[k] for k in part}, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    total = sum(t.nbytes for t in tensors.values())
    _write_json(path / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_dir(
    path: Path,
    cfg: ModelConfig,
    tensors: dict[str, np.ndarray],
    *,
    sharded: bool,
    bos: str | None,
    eos: str,
    chat_template: str,
) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _write_json(path / "config.json", cfg.to_dict())
    _write_weights(path, tensors, sharded)
    _write_json(path / "tokenizer.json", byte_tokenizer_json())
    decoder = {
        str(256 + i): {
            "content": c,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, c in enumerate(SPECIAL_TOKENS)
    }
    _write_json(
        path / "tokenizer_config.json",
        {
            "added_tokens_decoder": decoder,
            "bos_token": bos,
            "eos_token": eos,
            "pad_token": None,
            "chat_template": chat_template,
            "model_max_length": cfg.max_position_embeddings,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
        },
    )
    gen: dict[str, Any] = {
        "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else cfg.eos_token_ids[0]
    }
    if cfg.bos_token_id is not None:
        gen["bos_token_id"] = cfg.bos_token_id
    _write_json(path / "generation_config.json", gen)
    return path


TINY = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    attention_bias=False,
)
"""The one tiny model of the tests (two layers, hidden 64, 4 query and 2 KV heads of 16): every
tiny config below and in the tests is this one with a few fields replaced."""

SMOLLM2 = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    attention_bias=False,
    bos_token_id=1,
    eos_token_ids=(2,),
)
"""SmolLM2-135M's shape (its config.json), for tests that need the real model's numbers without
the model."""


def tiny_cfg(vocab: int = 160, bias: bool = False, tied: bool = True) -> ModelConfig:
    """TINY with another vocabulary, tied or not, Qwen2's q/k/v biases or not."""
    return dataclasses.replace(
        TINY,
        architecture="Qwen2ForCausalLM" if bias else "LlamaForCausalLM",
        vocab_size=vocab,
        tie_word_embeddings=tied,
        attention_bias=bias,
    )


def tiny_config(vocab_size: int = BYTE_VOCAB_SIZE, tie: bool = True, qwen2: bool = False) -> ModelConfig:
    """The ModelConfig make_tiny_llama writes: TINY over the byte vocabulary, with its special ids."""
    return dataclasses.replace(
        tiny_cfg(vocab_size, bias=qwen2, tied=tie),
        intermediate_size=128,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        bos_token_id=IM_START_ID,
        eos_token_ids=(IM_END_ID,),
    )


def tiny_tensors(cfg: ModelConfig, seed: int = 0, std: float = 0.1) -> dict[str, np.ndarray]:
    """Random HF-named weights: embeddings N(0, 0.3²) and projections N(0, std²) (0.1 gives
    logits of std ~2 on the tiny model: a non-trivial argmax); norms 1 + N(0, std²)."""
    rng = np.random.default_rng(seed)
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    default_std = std

    def normal(*shape: int, std: float = default_std) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    t = {"model.embed_tokens.weight": normal(v, d, std=0.3), "model.norm.weight": 1 + normal(d)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + normal(d)
        t[p + "post_attention_layernorm.weight"] = 1 + normal(d)
        t[p + "self_attn.q_proj.weight"] = normal(cfg.q_size, d)
        t[p + "self_attn.k_proj.weight"] = normal(cfg.kv_size, d)
        t[p + "self_attn.v_proj.weight"] = normal(cfg.kv_size, d)
        t[p + "self_attn.o_proj.weight"] = normal(d, cfg.q_size)
        t[p + "mlp.gate_proj.weight"] = normal(f, d)
        t[p + "mlp.up_proj.weight"] = normal(f, d)
        t[p + "mlp.down_proj.weight"] = normal(d, f)
        if cfg.attention_bias:
            t[p + "self_attn.q_proj.bias"] = normal(cfg.q_size)
            t[p + "self_attn.k_proj.bias"] = normal(cfg.kv_size)
            t[p + "self_attn.v_proj.bias"] = normal(cfg.kv_size)
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = normal(v, d, std=0.3)
    return t


def make_tiny_llama(
    path: str | Path,
    seed: int = 0,
    vocab_size: int = BYTE_VOCAB_SIZE,
    tie: bool = True,
    qwen2: bool = False,
    sharded: bool = False,
) -> Path:
    """A random-weight 2-layer model dir (hidden 64, 4 heads, 2 KV heads, head_dim 16, FFN 128).

    vocab_size >= 259; rows past the tokenizer's 259 tokens are never produced by encode."""
    if vocab_size < BYTE_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {BYTE_VOCAB_SIZE} (the byte tokenizer), got {vocab_size}")
    cfg = tiny_config(vocab_size, tie=tie, qwen2=qwen2)
    return _write_chatml_dir(Path(path), cfg, tiny_tensors(cfg, seed), sharded)


def _write_chatml_dir(path: Path, cfg: ModelConfig, tensors: dict[str, np.ndarray], sharded: bool) -> Path:
    """A model directory with the byte tokenizer, bos <|im_start|>, eos <|im_end|> and ChatML."""
    return _write_dir(
        path, cfg, tensors, sharded=sharded, bos="<|im_start|>", eos="<|im_end|>", chat_template=CHATML_TEMPLATE
    )


SUCC_MARGIN = 16.0  # logit of the successor byte; every other logit is 0


def succ_config() -> ModelConfig:
    """The ModelConfig make_succ writes (hidden 256 = one dimension per byte)."""
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=None,
        eos_token_ids=(ENDOFTEXT_ID,),
    )


def succ_tensors(cfg: ModelConfig) -> dict[str, np.ndarray]:
    """One-hot embeddings; o_proj and down_proj are zero so the residual stream is the
    embedding; final RMSNorm turns e_i into 16·e_i; lm_head maps dimension i to byte i+1."""
    d, v = cfg.hidden_size, cfg.vocab_size
    embed = np.zeros((v, d), np.float32)
    embed[np.arange(256), np.arange(256)] = 1.0
    embed[256:, ord("@")] = 1.0  # specials behave like '@', so 'A' follows them
    lm_head = np.zeros((v, d), np.float32)
    lm_head[(np.arange(256) + 1) % 256, np.arange(256)] = SUCC_MARGIN / np.sqrt(d)
    rng = np.random.default_rng(0)
    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": np.ones(d, np.float32),
        "lm_head.weight": lm_head,
        p + "input_layernorm.weight": np.ones(d, np.float32),
        p + "post_attention_layernorm.weight": np.ones(d, np.float32),
        p + "self_attn.q_proj.weight": (rng.standard_normal((cfg.q_size, d)) * 0.05).astype(np.float32),
        p + "self_attn.k_proj.weight": (rng.standard_normal((cfg.kv_size, d)) * 0.05).astype(np.float32),
        p + "self_attn.v_proj.weight": (rng.standard_normal((cfg.kv_size, d)) * 0.05).astype(np.float32),
        p + "self_attn.o_proj.weight": np.zeros((d, cfg.q_size), np.float32),
        p + "mlp.gate_proj.weight": (rng.standard_normal((cfg.intermediate_size, d)) * 0.05).astype(np.float32),
        p + "mlp.up_proj.weight": (rng.standard_normal((cfg.intermediate_size, d)) * 0.05).astype(np.float32),
        p + "mlp.down_proj.weight": np.zeros((d, cfg.intermediate_size), np.float32),
    }


def make_succ(path: str | Path, sharded: bool = False) -> Path:
    """The byte-level bigram model: greedy continuation of b"abc" is b"defg…"."""
    cfg = succ_config()
    return _write_dir(
        Path(path), cfg, succ_tensors(cfg), sharded=sharded, bos=None, eos="<|endoftext|>", chat_template=SUCC_TEMPLATE
    )


def succ_logits(token_id: int) -> np.ndarray:
    """Reference next-token logits of the succ model after `token_id` (any context) [V]."""
    cfg = succ_config()
    t = succ_tensors(cfg)
    x = t["model.embed_tokens.weight"][token_id]
    x = x / np.sqrt(np.mean(x * x) + cfg.rms_norm_eps)
    return t["lm_head.weight"] @ x


# The families (issue 32): one tiny config each, random weights drawn from hf_shapes, the same
# byte tokenizer. bench/families_reference.py runs transformers on these very directories and
# commits its logits (tests/golden/families/); tests/model/test_families.py checks tl against them.
FAMILIES = ("llama3", "mistral", "qwen3", "qwen3_moe", "gemma3", "qwen3_moe_gguf", "gemma3_gguf")
"""The last two: what a GGUF can state (llama.cpp's qwen3moe has no dense layers; its gemma3
takes query_pre_attn_scalar = head_dim), for tests/model/test_families.py's GGUF forms."""
FAMILY_SEQ_LEN = 72  # positions compared: past every window below, and across a chunk boundary


def family_config(name: str) -> ModelConfig:
    """A tiny config of the family that exercises its every difference from Llama 2."""
    from tl.model.config import FULL, SLIDING, RopeScaling

    base = tiny_config()
    common: dict[str, Any] = {"bos_token_id": IM_START_ID, "eos_token_ids": (IM_END_ID,)}
    if name == "llama3":  # Llama 3.1's rope scaling, untied head
        scaling = RopeScaling("llama3", 8.0, 1.0, 8.0, 1024)  # two blended frequencies: rope_freqs fits it
        return _replace(
            base, rope_scaling=scaling, tie_word_embeddings=False, rope_theta=500000.0, max_position_embeddings=4096
        )
    if name == "mistral":  # every layer sliding
        return _replace(base, architecture="MistralForCausalLM", sliding_window=16, layer_types=(SLIDING, SLIDING))
    if name == "qwen3":  # q/k norms; head_dim independent of hidden (4 x 32 != 64)
        return _replace(base, architecture="Qwen3ForCausalLM", head_dim=32, qk_norm=True, rope_theta=1000000.0)
    if name == "qwen3_moe":  # 4 experts, top 2, renormalized; layer 1 dense (mlp_only_layers)
        return _replace(
            base,
            architecture="Qwen3MoeForCausalLM",
            head_dim=32,
            qk_norm=True,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=(1,),
        )
    if name == "gemma3":  # two sliding layers (window 8, local base), one global with linear scaling
        return ModelConfig(
            **{
                **_fields(base),
                **common,
                "architecture": "Gemma3ForCausalLM",
                "num_hidden_layers": 3,
                "head_dim": 32,
                "num_key_value_heads": 1,
                "rope_theta": 1000000.0,
                "rope_scaling": RopeScaling("linear", 2.0),
                "qk_norm": True,
                "norm_offset": 1.0,
                "embed_scale": True,
                "hidden_act": "gelu_pytorch_tanh",
                "sandwich_norms": True,
                "query_scale": 24.0**-0.5,
                "sliding_window": 8,
                "layer_types": (SLIDING, SLIDING, FULL),
                "rope_local_theta": 10000.0,
            }
        )
    if name == "qwen3_moe_gguf":
        return _replace(family_config("qwen3_moe"), mlp_only_layers=())
    if name == "gemma3_gguf":
        return _replace(family_config("gemma3"), query_scale=32**-0.5)
    raise ValueError(f"unknown family {name!r} (known: {', '.join(FAMILIES)})")


def _fields(cfg: ModelConfig) -> dict[str, Any]:
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


def _replace(cfg: ModelConfig, **kw: Any) -> ModelConfig:
    return ModelConfig(**{**_fields(cfg), **kw})


def family_tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights for every tensor hf_shapes names: embeddings N(0, 0.3²), matrices
    N(0, 0.1²) (routers N(0, 1): distinct expert choices), norms 1 + N(0, 0.1²) in the
    family's convention (Gemma stores w of (1 + w): N(0, 0.1²))."""
    from tl.model.config import hf_shapes

    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in hf_shapes(cfg).items():
        x = rng.standard_normal(shape).astype(np.float32)
        if "norm" in name:
            x = 0.1 * x + (0.0 if cfg.norm_offset else 1.0)
        elif name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            x = 0.3 * x
        elif name.endswith("mlp.gate.weight"):
            pass
        else:
            x = 0.1 * x
        out[name] = x.astype(np.float32)
    return out


def make_family(path: str | Path, name: str, seed: int = 0) -> Path:
    """A tiny random-weight model directory of the family (the byte tokenizer, ChatML)."""
    cfg = family_config(name)
    return _write_chatml_dir(Path(path), cfg, family_tensors(cfg, seed), sharded=False)


def family_token_ids(seed: int = 1) -> np.ndarray:
    """The fixed token sequence the golden logits are computed over (FAMILY_SEQ_LEN byte ids)."""
    return np.random.default_rng(seed).integers(0, 256, FAMILY_SEQ_LEN).astype(np.int32)


HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: <tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' and m.get('tool_calls') %}<|im_start|>assistant\n"
    "{% for c in m['tool_calls'] %}<tool_call>\n{{ {'name': c['function']['name'], 'arguments': "
    "c['function']['arguments']} | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>{{ m['content'] }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
