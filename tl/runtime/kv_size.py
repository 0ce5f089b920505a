"""The KV cache's size, decided before anything is placed.

Owns: the bytes of one block (keys and values of every layer, in the cache's format:
tl/runtime/execution.py `kv_storage_of` says which), `num_kv_blocks` derived from
`kv_cache_memory_gib` when that is set (the budget holds every block, the scratch block the
runner adds included), and the start-up check that the cache and the weights fit the memory
this host has available (a CPU backend in one process: the cache is zeroed, so every page of it
becomes resident), refused with a message naming the numbers and what would fit instead of an
out-of-memory kill. Deterministic from the config and the model, except that check: every
process of a group sizes its cache alike. Tested by tests/runtime/test_kv_size.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from tl.core.config import ConfigError, EngineConfig
from tl.model.config import ModelConfig
from tl.model.gguf_model import Packed
from tl.runtime import backend
from tl.runtime.execution import kv_storage_of

GIB = 1 << 30


def _storage(ec: EngineConfig, platform: str) -> str:
    return kv_storage_of(ec, backend.resolve_dtype(ec.dtype, platform)).value


def block_bytes(cfg: ModelConfig, ec: EngineConfig, platform: str) -> int:
    """One block's bytes: keys and values, every layer, block_size tokens, every KV head."""
    storage = _storage(ec, platform)
    itemsize = 2 if storage == "bfloat16" else np.dtype(storage).itemsize
    return 2 * cfg.num_hidden_layers * ec.block_size * cfg.num_key_value_heads * cfg.head_dim * itemsize


def sized(cfg: ModelConfig, ec: EngineConfig, platform: str) -> EngineConfig:
    """ec with num_kv_blocks as kv_cache_memory_gib holds (ec itself when that is 0)."""
    if ec.kv_cache_memory_gib <= 0:
        return ec
    per_block = block_bytes(cfg, ec, platform)
    blocks = int(ec.kv_cache_memory_gib * GIB) // per_block - 1  # the scratch block is in the budget
    if blocks < 2:
        raise ConfigError(
            f"kv_cache_memory_gib = {ec.kv_cache_memory_gib} holds {blocks + 1} blocks of {per_block} bytes"
            f" ({ec.block_size} tokens of this model); at least 3 are needed"
            f" ({3 * per_block / GIB:.4f} GiB)"
        )
    return dataclasses.replace(ec, num_kv_blocks=blocks)


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's estimate of the bytes a new allocation can have without swapping (Linux
    MemAvailable); None where it does not say."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_fits(
    cfg: ModelConfig,
    ec: EngineConfig,
    platform: str,
    tensors: Mapping[str, np.ndarray | Packed],
    available: Callable[[], int | None] | None = None,
) -> None:
    """ConfigError when the KV cache and the weights need more than the host has available
    (`available`: mem_available unless given)."""
    if platform != "cpu":
        return
    free = (available or mem_available)()
    if free is None:
        return
    per_block = block_bytes(cfg, ec, platform)
    kv = per_block * (ec.num_kv_blocks + 1)
    weights = sum(int(t.data.nbytes if isinstance(t, Packed) else t.nbytes) for t in tensors.values())
    if kv + weights <= free:
        return
    fit = max(0, (free - weights) // per_block - 1)
    raise ConfigError(
        f"the KV cache ({ec.num_kv_blocks} blocks of {ec.block_size} tokens: {kv / GIB:.2f} GiB,"
        f" {_storage(ec, platform)}) and the weights"
        f" ({weights / GIB:.2f} GiB) need {(kv + weights) / GIB:.2f} GiB, and this host has"
        f" {free / GIB:.2f} GiB available: set num_kv_blocks to at most {fit}"
        f' (or kv_cache_memory_gib; kv_cache_dtype = "bfloat16" halves a float32 cache)'
    )
