"""The engine's differential checks on the real ModelRunner (tiny random Llama, CPU):
every request gets exactly the tokens it gets alone, with and without prefix caching,
chunked prefill, preemption (a small KV cache) and prompt-lookup speculation.

Two runners are built and warmed once (compiling is the cost on a 2-core CPU); engines
share them, the KV-cache limit is narrowed per engine by a proxy. An engine starts with
every block free, so stale KV left by an earlier engine is never read.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.differential import assert_concurrent_equals_alone
from tests.test_engine import BASE_CFG, check_engine, workload
from tl.config import EngineConfig
from tl.plan import Runner

jax = pytest.importorskip("jax")

CFG = BASE_CFG.replace(token_buckets=(8, 32), seq_buckets=(1, 4), max_logprobs=5, compile_cache_dir="")


class NarrowKV:
    """A runner seen with fewer KV blocks than it has (the engine only hands out ids below)."""

    def __init__(self, runner: Any, num_kv_blocks: int) -> None:
        self._runner = runner
        self.num_kv_blocks = num_kv_blocks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


@pytest.fixture(scope="module")
def runners() -> dict[str, Any]:
    import numpy as np

    from tests.models import tiny_config
    from tl.model import llama
    from tl.runner import ModelRunner

    cfg = tiny_config()
    params = jax.tree.map(np.asarray, llama.init_params(cfg, jax.random.key(0)))
    out = {}
    for spec in ("none", "prompt_lookup"):
        runner = ModelRunner(cfg, params, CFG.replace(speculative=spec))
        runner.warmup()
        out[spec] = runner
    return out


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"num_kv_blocks": 14, "prefix_cache": "radix", "prefill_chunk": 4, "speculative": "prompt_lookup"},
        {"num_kv_blocks": 14, "prefix_cache": "none", "prefill_chunk": 0, "speculative": "prompt_lookup"},
    ],
    ids=["plain", "everything", "tiny_kv_spec"],
)
def test_each_request_gets_exactly_what_it_gets_alone(runners: dict[str, Any], variant: dict[str, Any]) -> None:
    def factory(cfg: EngineConfig) -> Runner:
        return NarrowKV(runners[cfg.speculative], cfg.num_kv_blocks)  # type: ignore[return-value]

    cfg = CFG.replace(**variant)
    engine = assert_concurrent_equals_alone(factory, cfg, CFG, workload(), check=check_engine)
    assert engine.stats().kv_blocks_used == 0
    if cfg.num_kv_blocks == 14:
        assert engine.stats().preemptions > 0
