"""tl.model.convert_gguf on the families beyond Llama 2 / Qwen2: Qwen3 (q/k norms), Qwen3-MoE
(stacked experts, router), Gemma 3 (norms stored as 1 + w, sandwich norms, sliding layers),
Llama 3 (rope scaling as llama.cpp's rope_freqs tensor or as metadata).

Each tiny GGUF is written here the way llama.cpp's converter writes that family (its tensor
names and conventions spelled out below, not taken from tl), from random HF-named weights; the
conversion must give back the HF config and tensors, and `packed_tensors` the same tensors with
block formats kept. Also the real Gemma 3 270M GGUF's facts (slow: `tl pull gemma3-270m`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from tests.helpers.gguf_writer import (
    family_gguf,
    llama3_rope_freqs,
)
from tl.model.config import FULL, SLIDING, ModelConfig, RopeScaling, hf_shapes, load_model_config
from tl.model.convert_gguf import convert_gguf
from tl.model.files import check_shapes, read_tensors
from tl.model.gguf_model import GGUFError, Packed, packed_tensors

Q = gguf.GGMLQuantizationType
REPO_ROOT = Path(__file__).resolve().parents[2]
BASE = {
    "vocab_size": 259,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "bos_token_id": 257,
    "eos_token_id": 258,
}
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3": {**BASE, "architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": False},
    "qwen3moe": {
        **BASE,
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
    "gemma3": {
        **BASE,
        "architectures": ["Gemma3ForCausalLM"],
        "num_hidden_layers": 7,  # layers 0-4 slide, 5 is full, 6 slides (llama.cpp's pattern of 6)
        "num_key_value_heads": 1,
        "sliding_window": 8,
        "query_pre_attn_scalar": 16,
        "rope_local_base_freq": 10000.0,
        "hidden_activation": "gelu_pytorch_tanh",
    },
    "llama": {
        **BASE,
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
}


def family_config(arch: str, **overrides: Any) -> ModelConfig:
    return ModelConfig.from_dict({**CONFIGS[arch], **overrides})


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named weights of every shape hf_shapes lists; norms near Gemma's small w, else near 1."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in hf_shapes(cfg).items():
        x = rng.standard_normal(shape).astype(np.float32) * 0.1
        out[name] = x + np.float32(1.0) if name.endswith("norm.weight") and not cfg.norm_offset else x
    return out


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_family_round_trips(tmp_path: Path, arch: str) -> None:
    cfg = family_config(arch)
    hf = random_weights(cfg, seed=len(arch))
    out = convert_gguf(family_gguf(tmp_path / "m.gguf", cfg, hf, arch), tmp_path / "out", progress=False)
    assert load_model_config(out) == cfg
    got = read_tensors(out)
    check_shapes(got, cfg)
    assert sorted(got) == sorted(hf)
    for name, x in hf.items():
        if arch == "gemma3" and name.endswith("norm.weight"):  # (w + 1) - 1 in float32
            np.testing.assert_allclose(got[name], x, atol=1e-7, err_msg=name)
        else:
            assert np.array_equal(got[name], x), name


def test_gemma3_config_and_norms(tmp_path: Path) -> None:
    cfg = family_config("gemma3")
    assert cfg.layer_types == (SLIDING,) * 5 + (FULL, SLIDING)
    hf = random_weights(cfg)
    path = family_gguf(tmp_path / "g.gguf", cfg, hf, "gemma3")
    packed = packed_tensors(path)
    assert isinstance(packed["model.layers.0.pre_feedforward_layernorm.weight"], np.ndarray)
    for name in (
        "model.norm.weight",
        "model.layers.6.self_attn.k_norm.weight",
        "model.layers.6.post_attention_layernorm.weight",
    ):
        np.testing.assert_allclose(packed[name], hf[name], atol=1e-7)  # back to HF's w (the forward adds 1)
    got = load_model_config(convert_gguf(path, tmp_path / "o", progress=False))
    assert (got.norm_offset, got.embed_scale, got.sandwich_norms, got.qk_norm) == (1.0, True, True, True)
    assert (got.attn_scale, got.layer_rope(0), got.layer_rope(5)) == (16**-0.5, (10000.0, None), (1e6, None))
    assert got.hidden_act == "gelu_pytorch_tanh" and got.tie_word_embeddings
    pattern = [True, False, True, False, True, False, False]
    meta = {"gemma3.attention.sliding_window_pattern": pattern, "gemma3.rope.freq_base_swa": 20000.0}
    got = load_model_config(
        convert_gguf(family_gguf(tmp_path / "p.gguf", cfg, hf, "gemma3", meta=meta), tmp_path / "p")
    )
    assert got.layer_types == tuple(SLIDING if s else FULL for s in pattern) and got.rope_local_theta == 20000.0
    meta = {"gemma3.attention.sliding_window_pattern": 3}
    got = load_model_config(
        convert_gguf(family_gguf(tmp_path / "n.gguf", cfg, hf, "gemma3", meta=meta), tmp_path / "n")
    )
    assert got.layer_types == (SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL, SLIDING)
    no_window = family_config("gemma3", sliding_window=None, layer_types=[FULL] * 7)
    got = load_model_config(
        convert_gguf(family_gguf(tmp_path / "f.gguf", no_window, hf, "gemma3"), tmp_path / "f", progress=False)
    )
    assert got.sliding_window == 0 and not any(got.is_sliding(i) for i in range(7))


def test_gemma3_final_softcapping_is_refused(tmp_path: Path) -> None:
    cfg = family_config("gemma3")
    path = family_gguf(
        tmp_path / "s.gguf", cfg, random_weights(cfg), "gemma3", meta={"gemma3.final_logit_softcapping": 30.0}
    )
    with pytest.raises(GGUFError, match="s.gguf: final_logit_softcapping 30.0 is not supported"):
        convert_gguf(path, tmp_path / "o", progress=False)


def test_qwen3moe_experts_stay_packed_one_slice_each(tmp_path: Path) -> None:
    cfg = family_config("qwen3moe")
    hf = random_weights(cfg, seed=5)
    path = family_gguf(tmp_path / "moe.gguf", cfg, hf, "qwen3moe", qtype=Q.Q8_0)
    packed = packed_tensors(path)
    check_shapes(packed, cfg)  # type: ignore[arg-type]
    for e in range(cfg.num_experts):
        for part in ("gate_proj", "up_proj", "down_proj"):
            w = packed[f"model.layers.1.mlp.experts.{e}.{part}.weight"]
            x = hf[f"model.layers.1.mlp.experts.{e}.{part}.weight"]
            assert isinstance(w, Packed) and w.format == "q8_0" and w.shape == x.shape
            assert np.array_equal(w.data, gguf.quants.quantize(x, Q.Q8_0))  # this expert's rows, as quantized alone
            assert np.abs(w.to_float() - x).max() <= 0.01 * np.abs(x).max()
    router = packed["model.layers.0.mlp.gate.weight"]
    assert isinstance(router, Packed) and router.shape == (cfg.num_experts, cfg.hidden_size)
    floats = read_tensors(convert_gguf(path, tmp_path / "o", progress=False))
    assert np.array_equal(
        floats["model.layers.0.mlp.experts.3.down_proj.weight"],
        packed["model.layers.0.mlp.experts.3.down_proj.weight"].to_float(),
    )  # type: ignore[union-attr]
    got = load_model_config(tmp_path / "o")
    assert (got.num_experts, got.num_experts_per_tok, got.moe_intermediate_size, got.norm_topk_prob) == (4, 2, 32, True)
    assert all(got.is_moe(i) for i in range(2)) and got.qk_norm


@pytest.mark.parametrize(
    "scaling",
    [
        {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        {"factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0, "original_max_position_embeddings": 4096},
    ],
    ids=["llama3.1", "llama3.2", "other"],
)
def test_llama3_rope_scaling_from_rope_freqs(tmp_path: Path, scaling: dict[str, Any]) -> None:
    cfg = family_config("llama", rope_scaling={"rope_type": "llama3", **scaling})
    path = family_gguf(tmp_path / "l.gguf", cfg, random_weights(cfg), "llama")
    got = load_model_config(convert_gguf(path, tmp_path / "o", progress=False))
    assert got == cfg and got.rope_scaling == RopeScaling("llama3", **scaling)


def test_rope_scaling_metadata_and_refusals(tmp_path: Path) -> None:
    cfg = family_config("llama", rope_scaling=None)
    hf = random_weights(cfg)
    meta = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    got = load_model_config(
        convert_gguf(family_gguf(tmp_path / "lin.gguf", cfg, hf, "llama", meta=meta), tmp_path / "a")
    )
    assert got.rope_scaling == RopeScaling("linear", 4.0)
    meta = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}
    with pytest.raises(GGUFError, match="yarn.gguf: rope scaling type 'yarn' is not supported"):
        convert_gguf(family_gguf(tmp_path / "yarn.gguf", cfg, hf, "llama", meta=meta), tmp_path / "b")
    scaled = family_config("llama")
    freqs = llama3_rope_freqs(scaled.rope_theta, scaled.head_dim, scaled.rope_scaling.to_dict())  # type: ignore[union-attr]
    freqs[10] *= 1.5  # one divisor off Llama 3's curve
    bent = family_gguf(tmp_path / "bent.gguf", scaled, hf, "llama", rope_freqs=freqs)
    with pytest.raises(
        GGUFError, match=r"bent.gguf: tensor 'rope_freqs.weight' does not follow Llama 3's rope scaling"
    ):
        convert_gguf(bent, tmp_path / "c", progress=False)


def test_unknown_architecture_and_missing_tensors_are_named(tmp_path: Path) -> None:
    cfg = family_config("gemma3")
    hf = random_weights(cfg)
    path = family_gguf(tmp_path / "x.gguf", cfg, hf, "gemma3", drop=("blk.6.post_ffw_norm.weight",))
    for load in (packed_tensors, lambda p: convert_gguf(p, tmp_path / "o", progress=False)):
        with pytest.raises(GGUFError, match=r"x.gguf: tensor 'blk.6.post_ffw_norm.weight' is missing"):
            load(path)
    moe = family_config("qwen3moe")
    path = family_gguf(tmp_path / "e.gguf", moe, random_weights(moe), "qwen3moe", meta={"qwen3moe.expert_count": 3})
    with pytest.raises(GGUFError, match=r"e.gguf: tensor 'blk.0.ffn_gate_exps.weight' stacks 4 experts, expected 3"):
        packed_tensors(path)
    bad = family_gguf(tmp_path / "phi.gguf", cfg, hf, "gemma3", meta={"general.architecture": "phi3"})
    with pytest.raises(
        GGUFError, match=r"architecture 'phi3' is not supported \(supported: llama, qwen2, qwen3, qwen3moe, gemma3\)"
    ):
        convert_gguf(bad, tmp_path / "p", progress=False)


@pytest.mark.slow
def test_real_gemma3_270m(tmp_path: Path) -> None:
    from tl.entry.pull import pull

    d = pull("gemma3-270m", root=REPO_ROOT / "artifacts" / "models", progress=False)
    cfg = load_model_config(d)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (18, 640, 4, 1)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings) == (256, 2048, 262144, True)
    assert (cfg.sliding_window, cfg.rope_theta, cfg.rope_local_theta, cfg.attn_scale) == (512, 1e6, 10000.0, 256**-0.5)
    assert [i for i in range(18) if not cfg.is_sliding(i)] == [5, 11, 17] and cfg.rms_norm_eps == 1e-6
    assert not (d / "model.safetensors").exists()  # served packed from model.gguf
    tensors = read_tensors(d)
    check_shapes(tensors, cfg)  # type: ignore[arg-type]
    formats = {type(w).__name__ if isinstance(w, np.ndarray) else w.format for w in tensors.values()}
    assert formats == {"ndarray", "q8_0", "q5_0", "q4_k", "q6_k"}
    assert float(np.min(tensors["model.layers.0.post_attention_layernorm.weight"])) >= -1.0  # 1 + w >= 0
