"""EngineStats: the engine's counters and gauges at one instant, as /metrics and bench read them.

Owns only the records. Pure data: must not import jax. EngineStats is filled by tl/engine.py,
BackendInfo by tl/backend.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineStats:
    kv_blocks_free: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0  # unreferenced blocks kept for prefix reuse (evictable)
    queue_depth: int = 0  # requests waiting (not yet running)
    running: int = 0  # sequences holding KV blocks
    batch_tokens: int = 0  # tokens computed by the last step
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    preemptions: int = 0
    evictions: int = 0  # cached blocks evicted to make room
    spec_drafts_proposed: int = 0  # draft tokens proposed
    spec_drafts_accepted: int = 0  # of those, accepted
    steps: int = 0
    compilations: int = 0  # compiled step variants so far (flat after warm-up)

    @property
    def prefix_cache_hit_ratio(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """Where the engine runs: logged at start, shown in /v1/models and as tl_engine_backend_info."""

    platform: str = "cpu"  # the JAX platform: cpu, gpu or tpu
    device_kind: str = ""  # e.g. "cpu", "NVIDIA H100 80GB HBM3", "TPU v5 lite"
    device_count: int = 1  # devices in the engine's mesh
    tensor_parallel: int = 1
    process_count: int = 1  # jax.distributed processes (hosts) in the job
    dtype: str = "float32"
    kv_cache_dtype: str = "float32"  # what the KV cache holds: the dtype, or bfloat16 (kv_cache_dtype)
    attention_kernel: str = "reference"  # "cpu_native+reference": each step shape takes the one measured faster
    matmul_precision: str = "highest"  # float32 matmuls as run: "highest", or "high" (bf16x3 on AMX)
    matmul_kernel: str = "xla"  # "xla", "cpu_native", or "cpu_native+xla" (by row count, as measured)
    native_target: str = ""  # the native CPU library's build (kernels/cpu_build.py), "" where none is used
    kernel_choices: tuple[str, ...] = ()  # each measured class: its pick and the native kernel's ratio to XLA
    kv_heads: str = "sharded"  # "sharded" over the model axis, or "replicated" when they do not divide

    def labels(self) -> dict[str, str]:
        return {"platform": self.platform, "device_kind": self.device_kind, "device_count": str(self.device_count),
                "tensor_parallel": str(self.tensor_parallel), "process_count": str(self.process_count),
                "dtype": self.dtype, "kv_cache_dtype": self.kv_cache_dtype, "attention_kernel": self.attention_kernel,
                "matmul_precision": self.matmul_precision, "matmul_kernel": self.matmul_kernel,
                "native_target": self.native_target, "kv_heads": self.kv_heads}
