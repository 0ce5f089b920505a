"""Which paged-attention implementation a runner uses, and why.

Owns: the choice between the jnp reference (kernels/paged_attention.py), the Pallas kernels
(kernels/pallas_tpu.py, kernels/pallas_gpu.py) and the native CPU kernel (kernels/cpu_native.py)
from `[engine].attention_kernel` and the platform, the shard_map that runs a kernel per device
under tensor parallelism (a Pallas or FFI call is opaque to XLA's partitioner), and a trial
trace at the real shapes so that a kernel that refuses them (or, for cpu_native, cannot be
built here) falls back to the reference with the kernel's own message as the reason.
Must not: write the cache. Tested by tests/test_pallas_attention.py and tests/test_cpu_native.py.

"auto": pallas_tpu on TPU, pallas_gpu on GPU, cpu_native on CPU. Naming a Pallas kernel of
another platform runs it in interpret mode (tests do this); cpu_native runs on CPU only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kernels.paged_attention import AttnMetadata, paged_attention

PagedAttention = Callable[..., jax.Array]
"""(q [T,Hq,hd], k_new, v_new [T,Hk,hd], k_cache, v_cache (stored layout), layer, meta) -> [T,Hq,hd]."""
NATIVE = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cpu": "cpu_native"}


@dataclass(frozen=True)
class Choice:
    fn: PagedAttention
    name: str  # "reference", "cpu_native", "pallas_tpu" or "pallas_gpu" (+ " (interpret)")
    reason: str  # why, for the start-up log


@dataclass(frozen=True)
class MatmulChoice:
    fn: Callable[[jax.Array, Any], jax.Array | None] | None  # None: XLA's dot (so where fn returns None)
    name: str  # "xla" or "cpu_native"
    reason: str
    # The sampler's argmax and logsumexp of the logits rows in one pass (None: jnp's), chosen
    # with the matmul: an opaque call needs whole (unsharded) rows.
    argmax_lse: Callable[[jax.Array], tuple[jax.Array, jax.Array]] | None = None


def select_matmul(attention: Choice, mesh: Mesh) -> MatmulChoice:
    """The layers' float matmul: cpu_native's few-row kernel goes with cpu_native attention on one
    device (under tensor parallelism an opaque call would need the whole, sharded weights)."""
    if attention.name != "cpu_native":
        return MatmulChoice(None, "xla", f"attention is {attention.name}")
    if mesh.shape["model"] > 1:
        return MatmulChoice(None, "xla", "tensor parallel: XLA partitions its own dot")
    from kernels import cpu_native

    return MatmulChoice(cpu_native.matmul, "cpu_native", f"CPU: float rows <= {cpu_native.max_rows()}, int8 one row",
                        argmax_lse=cpu_native.argmax_lse)


def _kernel(name: str, interpret: bool) -> PagedAttention:
    if name == "cpu_native":
        from kernels import cpu_native

        return cpu_native.paged_attention
    if name == "pallas_tpu":
        from kernels import pallas_tpu

        return functools.partial(pallas_tpu.paged_attention, interpret=interpret)
    from kernels import pallas_gpu

    return functools.partial(pallas_gpu.paged_attention, interpret=interpret)


def _per_device(fn: PagedAttention, mesh: Mesh) -> PagedAttention:
    """Run fn on each device's heads: q/k/v split by head over "model", metadata replicated."""
    heads, kv = P(None, "model", None), P(None, None, "model", None, None)  # stored K/V: KV heads on axis 2

    def call(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
             layer: jax.Array, meta: AttnMetadata) -> jax.Array:
        meta_spec = jax.tree.map(lambda _: P(), meta)
        return jax.shard_map(fn, mesh=mesh, in_specs=(heads, heads, heads, kv, kv, P(), meta_spec),
                             out_specs=heads, check_vma=False)(q, k_new, v_new, k_cache, v_cache, layer, meta)

    return call


def select(requested: str, platform: str, mesh: Mesh, kv_sharded: bool, probe: tuple[Any, ...]) -> Choice:
    """The implementation for `requested` ("auto", "reference", "cpu_native", "pallas_tpu", "pallas_gpu").

    probe: ShapeDtypeStructs of one call (q, k_new, v_new, k_cache, v_cache, layer, meta) used
    for the trial trace.
    """
    name = NATIVE.get(platform, "reference") if requested == "auto" else requested
    if name == "reference":
        why = "configured" if requested == "reference" else f"no kernel is used on {platform}"
        return Choice(paged_attention, "reference", why)
    if name == "cpu_native" and platform != "cpu":
        return Choice(paged_attention, "reference", f"cpu_native runs on cpu, not {platform}")
    tp = mesh.shape["model"]
    if tp > 1 and not kv_sharded:
        return Choice(paged_attention, "reference",
                      f"{name} needs KV heads split over tensor_parallel={tp}; they are replicated")
    interpret = NATIVE.get(platform) != name and name != "cpu_native"
    fn = _kernel(name, interpret)
    if tp > 1:
        fn = _per_device(fn, mesh)
    try:
        jax.eval_shape(fn, *probe)
    except Exception as e:  # noqa: BLE001 -- any refusal by the kernel falls back; its message is the reason
        return Choice(paged_attention, "reference", f"{name} refused the model's shapes: {type(e).__name__}: {e}")
    label = name + (" (interpret)" if interpret else "")
    return Choice(fn, label, "configured" if requested != "auto" else f"native kernel for {platform}")
