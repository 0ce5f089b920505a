"""EngineStats: the engine's counters and gauges at one instant, as /metrics and bench read them.

Owns the records (a runner step's StepTimes included), and the engine thread's Histogram behind
EngineStats' histograms. Pure data: must not import jax. EngineStats is filled by tl/core/engine.py,
BackendInfo by tl/runtime/backend.py.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

STEP_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PROMPT_TOKENS_BUCKETS = (0, 1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
MASK_SECONDS_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
HOST_GAP_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 3e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1)
HOST_PARTS = ("schedule", "pack", "launch", "device", "unpack", "update", "between")
"""Where a busy engine's wall time goes, step after step (HostTimes): the scheduler's schedule,
the runner packing the inputs, launching the compiled call, waiting for its results (the
device's share), unpacking them, the scheduler's update, and the caller's own time between two
steps (AsyncEngine's token delivery)."""


@dataclass(frozen=True, slots=True)
class StepTimes:
    """When a runner's step passed each stage (time.perf_counter seconds): entered `execute`,
    inputs packed (bitmask rows included), the compiled call launched, its results on the host,
    unpacked. The engine turns them into the host time between steps (tl/core/engine.py)."""

    started: float
    packed: float
    launched: float
    fetched: float
    unpacked: float


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """Counts per bucket (observations <= bounds[i] and > bounds[i-1]; the last entry: above
    every bound), their sum and count: what a Prometheus histogram exports."""

    bounds: tuple[float, ...] = ()
    counts: tuple[int, ...] = ()
    total: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs, ending with +Inf."""
        out, acc = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            acc += n
            out.append((bound, acc))
        return out


class Histogram:
    """An engine-thread histogram (no lock: one writer; readers take snapshots)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """`count` observations of `value`."""
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.total += value * count

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.total)


class HostTimes:
    """An engine-thread account of each busy step's parts (HOST_PARTS, seconds summed) and of the
    host gap: the wall time from one step's results reaching the host to the next step's launch
    (unpack, update, the caller's delivery, schedule, pack, launch), when the engine stepped on
    without going idle in between. A call launched before the previous call's results were
    waited for (the engine's overlap) leaves no gap: the device had it queued; it is observed as 0."""

    def __init__(self) -> None:
        self.parts = dict.fromkeys(HOST_PARTS, 0.0)
        self.gap = Histogram(HOST_GAP_BUCKETS)
        self.steps = 0
        self._last: tuple[float, float] | None = None  # (fetched, update's end) of a step that left work

    def step(
        self,
        begun: float,
        schedule_s: float,
        times: StepTimes | None,
        ended: float,
        more: bool,
        own: bool = True,
        ahead: tuple[float, float, float] | None = None,
    ) -> None:
        """One engine step, from `begun` to `ended` (its update's end), schedule_s of it
        scheduling; `times`: the runner's stages of the call whose results it folded in (None: no
        work ran, or a runner that does not time them); own: this step launched that call (else an
        earlier step did, ahead); ahead: (started, packed, launched) of the call this step launched
        before waiting for those results; `more`: work is left, so the next step follows at once."""
        if times is None:
            self._last = None
            return
        p, last = self.parts, self._last
        if last is not None:
            p["between"] += begun - last[1]
            self.gap.observe(max(0.0, times.launched - last[0]) if own else 0.0)
        p["schedule"] += schedule_s
        waited_from = times.launched if own else max(times.launched, begun + schedule_s)
        if own:
            p["pack"] += times.packed - times.started
            p["launch"] += times.launched - times.packed
        if ahead is not None:
            p["pack"] += ahead[1] - ahead[0]
            p["launch"] += ahead[2] - ahead[1]
            waited_from = max(waited_from, ahead[2])
        p["device"] += max(0.0, times.fetched - waited_from)
        p["unpack"] += times.unpacked - times.fetched
        p["update"] += ended - times.unpacked
        self.steps += 1
        self._last = (times.fetched, ended) if more else None


@dataclass(frozen=True, slots=True)
class EngineStats:
    kv_blocks_free: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0  # unreferenced blocks kept for prefix reuse (evictable)
    queue_depth: int = 0  # requests waiting (not yet running; an embeddings request counts once)
    running: int = 0  # sequences holding KV blocks
    batch_tokens: int = 0  # tokens computed by the last step
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    preemptions: int = 0
    evictions: int = 0  # cached blocks evicted to make room
    spec_drafts_proposed: int = 0  # draft tokens proposed
    spec_drafts_accepted: int = 0  # of those, accepted
    steps: int = 0
    compilations: int = 0  # compiled step variants so far (flat once the background compilation is done)
    multi_step_compilations: int = 0  # several decode steps' programs compiled (each shape when first asked for)
    compile_pending: int = 0  # step variants not compiled yet (tl/runtime/compiler.py compiles them in the background)
    capped_steps: int = 0  # steps whose prompt work the cadence bound cut (tokens or time beside decodes)
    aborts: int = 0  # live sequences aborted (client disconnected or stopped, or cancelled)
    multi_step_calls: int = 0  # steps that ran several decode steps in one call (decode_steps)
    overlapped_steps: int = 0  # calls launched before the previous call's results were waited for (overlap)
    step_seconds: HistogramSnapshot = HistogramSnapshot()  # runner time of each step
    prompt_tokens_per_step: HistogramSnapshot = HistogramSnapshot()  # prompt-work tokens of each step
    mask_seconds: HistogramSnapshot = HistogramSnapshot()  # host time per constrained token's bitmask
    host_gap_seconds: HistogramSnapshot = HistogramSnapshot()  # results on the host -> next launch (HostTimes)
    step_part_seconds: tuple[tuple[str, float], ...] = ()  # HOST_PARTS' sums over timed steps
    timed_steps: int = 0  # steps those sums cover

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
    kv_cache_bytes: int = 0  # the KV cache's memory, keys and values of every layer (the scratch block too)
    kv_capacity_tokens: int = 0  # tokens its blocks hold: num_kv_blocks x block_size
    attention_kernel: str = "reference"  # "cpu_native+reference": each step shape takes the one measured faster
    matmul_precision: str = "highest"  # float32 matmuls as run: "highest", or "high" (bf16x3 on AMX)
    matmul_kernel: str = "xla"  # "xla", "cpu_native", or "cpu_native+xla" (by row count, as measured)
    native_target: str = ""  # the native CPU library's build (kernels/cpu_build.py), "" where none is used
    kernel_choices: tuple[str, ...] = ()  # each measured class: its pick and the native kernel's ratio to XLA
    kv_heads: str = "sharded"  # "sharded" over the model axis, or "replicated" when they do not divide
    weight_pages: str = "default"  # "huge": the weights in one mapping advised MADV_HUGEPAGE
    reasons: tuple[str, ...] = ()  # the execution plan's decisions, each with its reason (tl/runtime/execution.py)

    def labels(self) -> dict[str, str]:
        return {
            "platform": self.platform,
            "device_kind": self.device_kind,
            "device_count": str(self.device_count),
            "tensor_parallel": str(self.tensor_parallel),
            "process_count": str(self.process_count),
            "dtype": self.dtype,
            "kv_cache_dtype": self.kv_cache_dtype,
            "attention_kernel": self.attention_kernel,
            "matmul_precision": self.matmul_precision,
            "matmul_kernel": self.matmul_kernel,
            "native_target": self.native_target,
            "kv_heads": self.kv_heads,
            "weight_pages": self.weight_pages,
        }
