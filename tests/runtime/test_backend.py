"""tl/runtime/backend.py on one CPU device: platform and dtype resolution, the tensor-parallel checks."""

from __future__ import annotations

from typing import Any

import pytest
from jax.sharding import PartitionSpec as P

from tests.helpers.models import SMOLLM2, tiny_config
from tl.core.config import ConfigError
from tl.model.config import ModelConfig
from tl.runtime import backend


def test_platform_and_dtype() -> None:
    assert backend.resolve_platform("auto") == "cpu" == backend.resolve_platform("cpu")
    with pytest.raises(ConfigError, match="backend 'tpu' has no devices here; present: cpu"):
        backend.resolve_platform("tpu")
    assert backend.resolve_dtype("auto", "cpu") == "float32"
    assert backend.resolve_dtype("auto", "gpu") == backend.resolve_dtype("auto", "tpu") == "bfloat16"
    assert backend.resolve_dtype("float32", "tpu") == "float32"


def test_tensor_parallel_layout() -> None:
    cfg = tiny_config()  # 4 heads, 2 KV heads, FFN 128, vocab 259
    assert backend.tp_layout(cfg, 2) == backend.TPLayout(2, kv_sharded=True, vocab_sharded=False)
    assert backend.tp_layout(cfg, 4).kv_sharded is False  # KV heads replicated
    with pytest.raises(ConfigError, match="tensor_parallel=3 does not divide the model's 4 attention heads"):
        backend.tp_layout(cfg, 3)
    specs = _specs(cfg, "float32", backend.tp_layout(cfg, 4))
    lp = specs.layers[0]
    assert lp.wqkv is None and lp.wk.w == P(None, None) and specs.embed.w == P(None, None)  # whole
    assert lp.wq.w == P("model", None)  # [Hq*hd, D]: by output
    assert lp.w_gate_up.w == P("model", None, None)  # [F, 2, D]: by F
    with pytest.raises(ConfigError, match="needs 2 cpu devices; 1 present"):
        backend.make_mesh("cpu", 2)


def _specs(cfg: ModelConfig, weight_dtype: str, layout: backend.TPLayout) -> Any:
    """The PartitionSpecs the loaded weights declare (tl/model/weights.py) under layout."""
    import jax

    from tl.model import llama, loader, weights

    tensors = llama.init_params(cfg, jax.random.key(0))
    loaded = loader.load_weights(
        tensors, cfg, weight_dtype=weight_dtype, kv_sharded=layout.kv_sharded, vocab_sharded=layout.vocab_sharded
    )
    return weights.partition_specs(loaded)


def test_fused_and_int8_specs_follow_their_axes() -> None:
    """Fused wqkv [Hk,G+2,hd,D] splits by KV-head group; float and int8 q [*out,in] and scale [*out] by out."""
    from tl.model.weights import Dense, Int8

    cfg = tiny_config(vocab_size=264)
    layout = backend.tp_layout(cfg, 2)
    f32 = _specs(cfg, "float32", layout).layers[0]
    assert f32.wqkv == Dense(P("model", None, None, None), ("model", None, None, None))
    assert f32.wo.w == P(None, "model")
    i8 = _specs(cfg, "int8", layout)
    lp = i8.layers[0]
    assert (lp.wqkv.q, lp.wqkv.scale) == (P("model", None, None, None), P("model", None, None))
    assert isinstance(lp.w_gate_up, Int8) and (lp.w_gate_up.q, lp.w_gate_up.scale) == (
        P("model", None, None),
        P("model", None),
    )
    assert (lp.wo.q, lp.wo.scale) == (P(None, "model"), P(None))  # row-parallel: in split
    assert (i8.embed.q, i8.embed.scale) == (P("model", None), P("model"))
    assert lp.attn_norm.value == P(None)


def test_smollm2_shapes() -> None:
    smol = SMOLLM2
    assert backend.tp_layout(smol, 3) == backend.TPLayout(3, kv_sharded=True, vocab_sharded=True)
    for n in (2, 4):
        with pytest.raises(ConfigError, match="9 attention heads"):
            backend.tp_layout(smol, n)
