"""Where one engine runs: JAX platform, devices, dtype, the tensor-parallel mesh, multi-host start.

Owns: resolving `[engine].backend` ("auto": tpu, then gpu, then cpu) to a platform, the default
dtype of each platform, the ("data", "model") mesh of `tensor_parallel` devices, the check that
the model's head counts fit that mesh (and the PartitionSpecs that follow from it), and
`jax.distributed.initialize` for multi-host jobs. Must not: place arrays (tl/runtime/runner.py does),
read the environment except through the mapping it is handed (tl/entry/build.py passes os.environ).
Tested by tests/runtime/test_backend.py and, on 8 fake CPU devices, tests/runtime/test_tensor_parallel.py.

Megatron layout on the "model" axis (the specs come from llama.step_partition_specs; the fused
qkv and gate-up weights keep a KV-head and an FFN axis to split, see tl/model/llama.py):
q/k/v/gate/up column-parallel, o/down row-parallel (XLA inserts the all-reduce after them),
embedding and LM head split by vocab, KV cache split by KV head. Query heads must divide by N
(else start-up is refused). KV heads that do not divide by N are replicated: every device
holds all KV heads and computes their projections (the known-good answer when N exceeds the
KV head count, as vLLM does; it costs N x KV memory). A vocab that does not divide is
replicated too; an FFN width that does not divide is refused.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tl.core.config import ConfigError, Group
from tl.model.config import ModelConfig

log = logging.getLogger("tl.runtime.backend")
PLATFORMS = ("tpu", "gpu", "cpu")  # "auto" takes the first present
KV_SHARDED = P(None, None, "model", None, None)  # stored K [L, NB, Hk, hd, bs] and V [L, NB, Hk, bs, hd]
KV_REPLICATED = P()
JAX_INIT_MARGIN_S = 5  # jax.distributed's own start-up bound runs this much past group_start_timeout_s


def available_platforms() -> list[str]:
    found = []
    for p in PLATFORMS:
        try:
            if jax.devices(p):
                found.append(p)
        except RuntimeError:
            continue
    return found


def resolve_platform(backend: str) -> str:
    """The JAX platform for `[engine].backend`; a missing one is refused with what is present."""
    found = available_platforms()
    if backend == "auto":
        return found[0]
    if backend not in found:
        raise ConfigError(f"backend {backend!r} has no devices here; present: {', '.join(found)}")
    return backend


def resolve_dtype(dtype: str, platform: str) -> str:
    """ "auto" is float32 on CPU (bf16 is 3-8x slower there) and bfloat16 on GPU/TPU."""
    if dtype != "auto":
        return dtype
    return "float32" if platform == "cpu" else "bfloat16"


@dataclass(frozen=True, slots=True)
class TPLayout:
    """What tensor parallelism of width N does to one model."""

    tensor_parallel: int
    kv_sharded: bool  # KV heads split over "model"; else replicated on every device
    vocab_sharded: bool

    @property
    def kv_spec(self) -> P:
        return KV_SHARDED if self.kv_sharded else KV_REPLICATED


def tp_layout(cfg: ModelConfig, n: int) -> TPLayout:
    """Check that the model fits an N-wide "model" axis; refuse with the numbers when it does not."""
    hq, hk = cfg.num_attention_heads, cfg.num_key_value_heads
    if hq % n:
        raise ConfigError(
            f"tensor_parallel={n} does not divide the model's {hq} attention heads; use a divisor of {hq}"
        )
    if cfg.intermediate_size % n:
        raise ConfigError(f"tensor_parallel={n} does not divide the model's FFN width {cfg.intermediate_size}")
    return TPLayout(n, kv_sharded=hk % n == 0, vocab_sharded=cfg.vocab_size % n == 0)


def make_mesh(platform: str, n: int) -> Mesh:
    """The first N devices of the platform (over all hosts) as a (1, N) ("data", "model") mesh; a
    multi-host job's mesh is all of them (every process runs every step)."""
    devices = jax.devices(platform)
    if len(devices) < n:
        raise ConfigError(f"tensor_parallel={n} needs {n} {platform} devices; {len(devices)} present")
    if jax.process_count() > 1 and n != len(devices):
        raise ConfigError(
            f"a multi-host job serves one model over all its devices: tensor_parallel must be "
            f"{len(devices)} ({jax.process_count()} processes), got {n}"
        )
    return Mesh(np.array(devices[:n]).reshape(1, n), ("data", "model"))


def process_index_count() -> tuple[int, int]:
    """(this process's index, processes in the job): (0, 1) on one host."""
    return jax.process_index(), jax.process_count()


def init_distributed(group: Group | None, group_start_timeout_s: float) -> bool:
    """Join the multi-host job `group` before any device is touched; False (nothing done) on one host.

    This waits for every process of the job. JAX's own bound on that wait is
    group_start_timeout_s plus JAX_INIT_MARGIN_S: on expiry JAX aborts the process naming no one,
    so tl/entry/group_start.py's watchdog (the bound itself) must speak first."""
    if group is None:
        return False
    if not jax.distributed.is_initialized():
        args = group.jax_args()
        args["initialization_timeout"] = math.ceil(group_start_timeout_s) + JAX_INIT_MARGIN_S
        # JAX's preemption service would take SIGTERM over (its notifier's handler replaces the
        # server's drain and a follower's log-and-wait); tl never asks it for a sync point.
        jax.config.update("jax_enable_preemption_service", False)
        log.info("jax.distributed.initialize(%s)", ", ".join(f"{k}={v!r}" for k, v in args.items()))
        jax.distributed.initialize(**args)
    log.info(
        "process %d of %d; %d global devices, %d local",
        jax.process_index(),
        jax.process_count(),
        jax.device_count(),
        jax.local_device_count(),
    )
    return True
