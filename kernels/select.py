"""Which paged-attention and matmul implementations a runner uses, and why.

Owns: the native CPU library a runner may use (`native_library`: built for `[engine]
native_target`, or why not), the choice between the jnp reference (kernels/paged_attention.py),
the Pallas kernels (kernels/pallas_tpu.py, kernels/pallas_gpu.py) and the native CPU kernel
from `[engine].attention_kernel` and the platform, the shard_map that runs a kernel per device
under tensor parallelism (a Pallas or FFI call is opaque to XLA's partitioner), a trial trace at
the real shapes so that a kernel that refuses them falls back to the reference with the
kernel's own message as the reason (traced with every sliding window the model's layers use:
a kernel without windows, pallas_gpu, falls back for such a model); the layers' matmul from
`[engine].matmul_kernel`.
Must not: write the cache, measure anything. Tested by tests/kernels/test_pallas_attention.py,
tests/kernels/test_cpu_native.py and tests/runtime/test_verdicts.py.

"auto": pallas_tpu on TPU, pallas_gpu on GPU, cpu_native on CPU (where the library builds;
unmeasured: its rows do not depend on their step, the reference's do). Naming a Pallas
kernel of another platform runs it in interpret mode (tests do this); cpu_native runs on CPU
only, and naming it forces it at every shape.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kernels.cpu_build import NativeUnavailable
from kernels.paged_attention import AttnArgs, PagedAttention, paged_attention

if TYPE_CHECKING:
    from kernels.cpu_native import NativeLib

Matmul = Callable[[jax.Array, Any], "jax.Array | None"]
ArgmaxLse = Callable[[jax.Array], tuple[jax.Array, jax.Array]]
NATIVE = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cpu": "cpu_native"}


@dataclass(frozen=True)
class Choice:
    fn: PagedAttention
    name: str  # "reference", "cpu_native", "pallas_tpu" or "pallas_gpu" (+ " (interpret)")
    reason: str  # why, for the start-up log


@dataclass(frozen=True)
class MatmulChoice:
    fn: Matmul | None  # None: XLA's dot (so where fn returns None)
    name: str  # "xla" or "cpu_native"
    reason: str
    # The sampler's argmax and logsumexp of the logits rows in one pass (None: jnp's), chosen
    # with the matmul: an opaque call needs whole (unsharded) rows.
    argmax_lse: ArgmaxLse | None = None
    measured: bool = False  # "auto": native or XLA at every row count, as measured on the model


def native_library(platform: str, target: str, *, cache_dir: str = "", cxx: str = "") -> tuple[NativeLib | None, str]:
    """The native CPU library for `target` ("auto": the best build this CPU runs) on the CPU
    platform, built now if needed (into `cache_dir` by `cxx`: `[engine] native_cache_dir` and
    `native_cxx`, empty for the defaults), or None and why (one line: no compiler, the first
    compiler error and where the log is, a target this CPU cannot run)."""
    if platform != "cpu":
        return None, f"native kernels run on cpu, not {platform}"
    from kernels import cpu_native

    try:
        return cpu_native.library(target, cache_dir=cache_dir, cxx=cxx), ""
    except NativeUnavailable as e:
        return None, str(e)


def select_matmul(requested: str, native: NativeLib | None, why_not: str, mesh: Mesh) -> MatmulChoice:
    """The layers' float matmul: the native kernels where the library is and the model is on
    one device (under tensor parallelism an opaque call would need the whole, sharded weights)."""
    if requested == "xla":
        return MatmulChoice(None, "xla", "configured")
    if native is None:
        return MatmulChoice(None, "xla", f"cpu_native unavailable: {why_not}")
    if mesh.shape["model"] > 1:
        return MatmulChoice(None, "xla", "tensor parallel: XLA partitions its own dot")
    auto = requested == "auto"
    why = f"{native.target.name} build: " + ("by measurement on the model" if auto else "configured")
    return MatmulChoice(native.matmul, "cpu_native", why, argmax_lse=native.argmax_lse, measured=auto)


def _kernel(name: str, interpret: bool, native: NativeLib | None) -> PagedAttention:
    if name == "cpu_native":
        assert native is not None
        return native.paged_attention
    if name == "pallas_tpu":
        from kernels import pallas_tpu

        return functools.partial(pallas_tpu.paged_attention, interpret=interpret)
    from kernels import pallas_gpu

    return functools.partial(pallas_gpu.paged_attention, interpret=interpret)


def _per_device(fn: PagedAttention, mesh: Mesh) -> PagedAttention:
    """Run fn on each device's heads: q/k/v split by head over "model", metadata replicated."""
    heads, kv = P(None, "model", None), P(None, None, "model", None, None)  # stored K/V: KV heads on axis 2

    def call(a: AttnArgs) -> jax.Array:
        specs = AttnArgs(heads, heads, heads, kv, kv, P(), jax.tree.map(lambda _: P(), a.meta))
        return jax.shard_map(fn, mesh=mesh, in_specs=(specs,), out_specs=heads, check_vma=False)(a)

    return call


def select(
    requested: str,
    platform: str,
    mesh: Mesh,
    kv_sharded: bool,
    probe: AttnArgs,
    native: NativeLib | None = None,
    why_not: str = "",
    windows: Sequence[int] = (),
) -> Choice:
    """The implementation for `requested` ("auto", "reference", "cpu_native", "pallas_tpu", "pallas_gpu").

    probe: one call's arguments as ShapeDtypeStructs, for the trial trace. native / why_not:
    `native_library`'s answer (cpu_native only). windows: the sliding windows of the model's
    layers (`AttnMetadata.window`); the trial traces the probe with its own window and each of
    them, so that one implementation serves every layer.
    """
    name = NATIVE.get(platform, "reference") if requested == "auto" else requested
    if name == "reference":
        why = "configured" if requested == "reference" else f"no kernel is used on {platform}"
        return Choice(paged_attention, "reference", why)
    if name == "cpu_native" and platform != "cpu":
        return Choice(paged_attention, "reference", f"cpu_native runs on cpu, not {platform}")
    if name == "cpu_native" and native is None:
        return Choice(paged_attention, "reference", f"cpu_native unavailable: {why_not}")
    tp = mesh.shape["model"]
    if tp > 1 and not kv_sharded:
        return Choice(
            paged_attention, "reference", f"{name} needs KV heads split over tensor_parallel={tp}; they are replicated"
        )
    interpret = NATIVE.get(platform) != name and name != "cpu_native"
    fn = _kernel(name, interpret, native)
    if tp > 1:
        fn = _per_device(fn, mesh)
    try:
        for window in sorted({probe.meta.window, *windows}):
            jax.eval_shape(fn, probe._replace(meta=dataclasses.replace(probe.meta, window=window)))
    except Exception as e:  # noqa: BLE001 -- any refusal by the kernel falls back; its message is the reason
        return Choice(paged_attention, "reference", f"{name} refused the model's shapes: {type(e).__name__}: {e}")
    label = name + (" (interpret)" if interpret else "")
    if name == "cpu_native":
        assert native is not None
        # Not measured against the reference: the native kernel computes every token as a decode
        # of its own, so a row's answer does not depend on its step; the reference's does.
        why = "configured" if requested != "auto" else "the one whose rows do not depend on their step"
        return Choice(fn, label, f"{native.target.name} build: {why}")
    return Choice(fn, label, "configured" if requested != "auto" else f"native kernel for {platform}")
