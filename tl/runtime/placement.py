"""Placement: the model's weights and the KV cache as device arrays on the runner's mesh.

Owns: converting host weights (Hugging Face tensors) into the step layout (tl/model/loader.py
`load_weights`, straight from the tensors), their NamedShardings from the axes each parameter declares
(tl/model/weights.py `partition_specs`), putting
them on the devices (on one CPU device: into one huge-page mapping, tl/runtime/weight_pages.py, with
XLA's own buffers as the fallback and its reason), and allocating the paged KV cache zeroed in
its storage dtype. What to place how is decided by tl/runtime/execution.py; this module only does it.
Must not: decide kernels or precision, compile steps. Tested by tests/runtime/test_runner.py and
tests/runtime/test_weight_pages.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels import paged_attention
from tl.model import llama, loader, weights
from tl.model.config import ModelConfig
from tl.model.encodings.panels import PANEL_FORMATS, pack
from tl.model.moe import Experts
from tl.runtime import backend, weight_pages


@dataclass(frozen=True, slots=True)
class PlacedWeights:
    """The step-layout weights on the devices, and where their memory came from."""

    params: llama.Weights
    pages: str  # "huge" or "default"
    reason: str  # what came of it (the mapping's size, or why it failed); "" for default pages


def place_weights(
    tensors: Mapping[str, np.ndarray],
    cfg: ModelConfig,
    mesh: Mesh,
    layout: backend.TPLayout,
    dtype: Any,
    weight_dtype: str,
    *,
    pack_bf16x3: bool,
    huge_pages: bool,
    panels: bool = False,
) -> PlacedWeights:
    """tensors: Hugging Face names -> host arrays (memory-mapped where the file allows).
    pack_bf16x3: keep each float matrix's packed bf16x3 copy beside it (matmul_precision
    "high"). huge_pages: as the plan says; where the mapping then fails, XLA's buffers, and the
    reason is the failure. panels: q8_0 / q4_0 / q4_1 matrices repacked for the native kernels
    (tl/model/encodings/panels.py `pack`), on the host before placement."""
    if pack_bf16x3 and weight_dtype != "float32":
        raise ValueError(f"{weight_dtype} weights have no bf16x3 packing")
    encoding = "bf16x3" if pack_bf16x3 else weight_dtype  # tl/model/weights.py ENCODINGS
    step = loader.load_weights(
        tensors,
        cfg,
        dtype,
        encoding,
        kv_sharded=layout.kv_sharded,
        vocab_sharded=layout.vocab_sharded,
        tensor_parallel=layout.tensor_parallel,
    )
    if panels:
        step = _pack_panels(step)
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), weights.partition_specs(step), is_leaf=lambda x: isinstance(x, P)
    )
    if not huge_pages:
        return PlacedWeights(jax.device_put(step, shardings), "default", "")
    try:
        params, nbytes = weight_pages.place(step, shardings)
    except OSError as e:
        return PlacedWeights(jax.device_put(step, shardings), "default", f"huge configured; default pages: {e}")
    return PlacedWeights(params, "huge", f"{nbytes >> 20} MiB advised MADV_HUGEPAGE")


def _pack_panels(step: llama.Weights) -> llama.Weights:
    """Every q8_0 / q4_0 / q4_1 linear and table repacked into panels, but a mixture-of-experts
    layer's: its expert weights [E, ...] are looked up by expert (tl/model/moe.py `take`), and a
    panel spans 16 rows of the flattened outputs."""

    def one(w: Any) -> Any:
        return pack(w) if isinstance(w, weights.Blocks) and w.fmt.name in PANEL_FORMATS else w

    packed: llama.Weights = jax.tree.map(one, step, is_leaf=lambda x: weights.is_param(x) or isinstance(x, Experts))
    return packed


def alloc_kv(
    cfg: ModelConfig, mesh: Mesh, spec: P, num_blocks: int, block_size: int, dtype: Any
) -> tuple[jax.Array, jax.Array]:
    """The zeroed (k, v) cache of num_blocks blocks (the runner adds the scratch block) in the
    stored layout of kernels/paged_attention.py, sharded by spec."""
    dims = (cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    sh = NamedSharding(mesh, spec)

    def alloc(kind: str) -> jax.Array:
        shape = paged_attention.cache_shape(kind, *dims)
        out: jax.Array = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sh)()
        return out

    return alloc("k"), alloc("v")
