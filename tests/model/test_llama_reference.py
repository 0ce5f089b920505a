"""tl/model/llama.py against an independent plain-numpy forward (shares no code with tl/).

The reference takes Hugging Face named [out,in] tensors, so load_weights is tested too.
Tolerance: max |Δlogit| <= 1e-4 in float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import models
from tests.helpers.numpy_llama import np_forward
from tl.model import llama, loader, weights
from tl.model.config import ModelConfig, ModelDirError


def tiny_cfg(*, tied: bool = True, bias: bool = False, vocab: int = 160) -> ModelConfig:
    return dataclasses.replace(models.tiny_cfg(vocab, bias, tied), max_position_embeddings=256)


def random_hf(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    D, F, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"model.embed_tokens.weight": w(cfg.vocab_size, D), "model.norm.weight": norm(D)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        t |= {
            p + "input_layernorm.weight": norm(D),
            p + "post_attention_layernorm.weight": norm(D),
            p + "self_attn.q_proj.weight": w(q, D),
            p + "self_attn.k_proj.weight": w(kv, D),
            p + "self_attn.v_proj.weight": w(kv, D),
            p + "self_attn.o_proj.weight": w(D, q),
            p + "mlp.gate_proj.weight": w(F, D),
            p + "mlp.up_proj.weight": w(F, D),
            p + "mlp.down_proj.weight": w(D, F),
        }
        if cfg.attention_bias:
            for n, size in (("q", q), ("k", kv), ("v", kv)):
                t[p + f"self_attn.{n}_proj.bias"] = (0.1 * rng.standard_normal(size)).astype(np.float32)
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = w(cfg.vocab_size, D)
    return t


@pytest.mark.parametrize("tied,bias", [(True, False), (False, False), (True, True), (False, True)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dense_forward_matches_numpy(tied: bool, bias: bool, seed: int) -> None:
    cfg = tiny_cfg(tied=tied, bias=bias)
    tensors = random_hf(cfg, seed)
    ids = np.random.default_rng(seed + 100).integers(0, cfg.vocab_size, 23).tolist()
    ref = np_forward(tensors, cfg, ids)
    for fused in (True, False):  # fused wqkv, or wq/wk/wv apart (tensor parallel, KV heads whole)
        params = loader.load_weights(tensors, cfg, kv_sharded=fused)
        assert (params.layers[0].wqkv is not None) == fused
        _, logits = jax.jit(llama.forward_dense, static_argnums=1)(params, cfg, jnp.asarray(ids, jnp.int32))
        assert np.abs(np.asarray(logits) - ref).max() <= 1e-4


def test_init_and_load_describe_the_same_tensors() -> None:
    cfg = tiny_cfg(tied=False, bias=True)
    tensors = llama.init_params(cfg, jax.random.key(0))
    assert {k: v.shape for k, v in tensors.items()} == llama.hf_shapes(cfg)
    params = loader.load_weights(tensors, cfg)
    specs = weights.partition_specs(params)
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    assert jax.tree.structure(specs, is_leaf=is_spec) == jax.tree.structure(params)
    for spec, leaf in zip(jax.tree.leaves(specs, is_leaf=is_spec), jax.tree.leaves(params), strict=True):
        assert len(spec) in (0, leaf.ndim)  # every declared axis list matches its array


def test_loading_copies_only_what_it_fuses() -> None:
    """Matrices stored as Hugging Face stores them are the loaded tensors themselves; the fused
    wqkv and w_gate_up are new arrays."""
    cfg = tiny_cfg(tied=False)
    tensors = random_hf(cfg, 0)
    params = loader.load_weights(tensors, cfg)
    lp = params.layers[1]
    assert lp.wo.w is tensors["model.layers.1.self_attn.o_proj.weight"]
    assert lp.w_down.w is tensors["model.layers.1.mlp.down_proj.weight"]
    assert params.embed.w is tensors["model.embed_tokens.weight"] and params.lm_head.w is tensors["lm_head.weight"]
    assert not np.shares_memory(lp.wqkv.w, tensors["model.layers.1.self_attn.q_proj.weight"])


def test_missing_or_misshapen_tensor_is_named() -> None:
    cfg = tiny_cfg(tied=False)
    tensors = random_hf(cfg, 0)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ModelDirError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        loader.load_weights(tensors, cfg)
    tensors = random_hf(cfg, 0)
    del tensors["lm_head.weight"]
    with pytest.raises(ModelDirError, match="lm_head.weight"):
        loader.load_weights(tensors, cfg)
    tensors = random_hf(cfg, 0)
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1]
    with pytest.raises(ModelDirError, match=r"'model.norm.weight' has shape \(63,\), expected \(64,\)"):
        loader.load_weights(tensors, cfg)
