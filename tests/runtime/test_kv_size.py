"""tl/runtime/kv_size.py: a block's bytes by hand, num_kv_blocks from kv_cache_memory_gib (the
scratch block in the budget), a budget too small refused by name, and a cache that cannot fit
the host refused at start-up with the numbers and what would fit, instead of an OOM kill."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from tests.helpers.models import SMOLLM2, TINY
from tests.helpers.runner import ENGINE
from tl.core.config import ConfigError
from tl.model import llama
from tl.model.gguf_model import Packed
from tl.runtime import kv_size
from tl.runtime.runner import ModelRunner
from tl.runtime.startup import start

MIB = 1 << 20


F32 = ENGINE.replace(kv_cache_dtype="float32")


def test_a_blocks_bytes_are_keys_and_values_of_every_layer() -> None:
    # 2 (k, v) x 2 layers x 4 tokens x 2 KV heads x 16 dims x 4 bytes
    assert kv_size.block_bytes(TINY, F32, "cpu") == 2 * 2 * 4 * 2 * 16 * 4 == 2048
    assert kv_size.block_bytes(TINY, ENGINE, "cpu") == 2048  # "auto": the compute dtype, float32 on a CPU
    assert kv_size.block_bytes(TINY, ENGINE, "gpu") == 1024  # bf16 off a CPU
    assert kv_size.block_bytes(TINY, ENGINE.replace(kv_cache_dtype="bfloat16"), "cpu") == 1024
    assert kv_size.block_bytes(SMOLLM2, F32.replace(block_size=16), "cpu") == 720 * 1024  # the README's figure
    assert kv_size.block_bytes(SMOLLM2, ENGINE.replace(block_size=16, kv_cache_dtype="bfloat16"), "cpu") == 360 * 1024
    with pytest.raises(ConfigError, match='kv_cache_dtype = "float32" needs dtype float32; the compute dtype'):
        kv_size.block_bytes(TINY, F32, "gpu")  # "auto" dtype is bf16 off a CPU


def test_a_memory_budget_sizes_the_blocks_scratch_included() -> None:
    one_mib = F32.replace(kv_cache_memory_gib=1 / 1024, num_kv_blocks=7)
    assert kv_size.sized(TINY, one_mib, "cpu").num_kv_blocks == MIB // 2048 - 1 == 511
    assert kv_size.sized(TINY, one_mib.replace(kv_cache_dtype="bfloat16"), "cpu").num_kv_blocks == 1023
    assert kv_size.sized(TINY, ENGINE, "cpu") is ENGINE  # no budget: num_kv_blocks as configured
    with pytest.raises(ConfigError, match=r"kv_cache_memory_gib = 5e-06 holds 2 blocks of 2048 bytes"):
        kv_size.sized(TINY, F32.replace(kv_cache_memory_gib=5e-6), "cpu")
    with pytest.raises(ValueError, match="kv_cache_memory_gib must be >= 0, got -1"):
        ENGINE.replace(kv_cache_memory_gib=-1.0)


def test_a_runner_sized_by_budget_holds_exactly_it() -> None:
    params = jax.tree.map(np.asarray, llama.init_params(TINY, jax.random.key(0)))
    runner = ModelRunner(start(TINY, params, F32.replace(kv_cache_memory_gib=1 / 1024)))
    assert runner.num_kv_blocks == 511 and runner.engine_config.num_kv_blocks == 511
    assert sum(x.nbytes for x in runner.kv_cache) == MIB  # the scratch block's bytes are in the MiB
    info = runner.backend_info
    assert (info.kv_cache_bytes, info.kv_capacity_tokens) == (MIB, 511 * 4)


def test_a_cache_the_host_cannot_hold_is_refused_with_what_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    # 4,000 bytes: 3,000 of float32, and 1,000 of a GGUF's blocks served as they are
    weights = {"w": np.zeros(750, np.float32), "q": Packed("q8_0", np.zeros((4, 250), np.uint8), 8 * 32)}
    cfg = F32.replace(num_kv_blocks=99)  # 100 blocks with the scratch: 204,800 bytes
    kv_size.check_fits(TINY, cfg, "cpu", weights, lambda: 204_800 + 4_000)  # just fits
    kv_size.check_fits(TINY, cfg, "gpu", weights, lambda: 0)  # device memory is not the host's
    kv_size.check_fits(TINY, cfg, "cpu", weights, lambda: None)  # no MemAvailable: no check
    with pytest.raises(ConfigError) as e:
        kv_size.check_fits(TINY, cfg, "cpu", weights, lambda: 204_800 + 3_999)
    # (208,799 - 4,000) // 2048 = 99 blocks, one of them the scratch: 98
    assert "the KV cache (99 blocks of 4 tokens: 0.00 GiB, float32)" in str(e.value)
    assert 'at most 98 (or kv_cache_memory_gib; kv_cache_dtype = "bfloat16" halves a float32 cache)' in str(e.value)
    # at start-up, before anything is placed
    monkeypatch.setattr(kv_size, "mem_available", lambda: 1000)
    params = jax.tree.map(np.asarray, llama.init_params(TINY, jax.random.key(0)))
    with pytest.raises(ConfigError, match="this host has 0.00 GiB available: set num_kv_blocks to at most 0"):
        start(TINY, params, ENGINE)


def test_mem_available_reads_meminfo(tmp_path: Path) -> None:
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n")
    assert kv_size.mem_available(f) == 20_000_000 * 1024
    f.write_text("MemTotal:       24000000 kB\n")
    assert kv_size.mem_available(f) is None
    assert kv_size.mem_available(tmp_path / "absent") is None
    assert (kv_size.mem_available() or 0) > 0  # this Linux host's
