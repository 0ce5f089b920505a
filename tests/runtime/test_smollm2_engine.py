"""The engine's differential checks on the real SmolLM2-135M as served by default (its Q4_1
GGUF, the native kernels this CPU's build chose), at temperature 0 and seeded sampling.

Each of several requests (different lengths, arriving at different steps, sharing
SmolLM2's default system turn as a prefix) gets exactly the tokens and logprobs, bit for bit,
it gets alone on a plain engine, with prefix caching, chunked prefill, a KV cache so small that
preemption happens, and prompt-lookup speculation, alone and all together (issue 48: the
quantized model's answers once depended on the step a row landed in). One runner, compiled once
with room for drafts, serves every engine; the KV-cache limit is narrowed per engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers.differential import Arrival, assert_concurrent_equals_alone
from tests.helpers.engine_cases import NarrowKV, check_engine
from tl.core.config import EngineConfig
from tl.core.plan import Runner
from tl.core.request import GenRequest, SamplingParams

pytestmark = pytest.mark.slow

BASE = EngineConfig(
    block_size=16,
    num_kv_blocks=64,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    token_buckets=(8, 64),  # two step variants (8 and 64 tokens, 4 sequences): two compiles, not six
    seq_buckets=(4,),
    prefill_chunk=0,
    prefix_cache="none",
    speculative="none",
    max_logprobs=0,
    compile_cache_dir="",
)
QUESTIONS = [
    (0, "What is the capital of France?", 12),
    (0, "Repeat exactly: red green blue, red green blue, red green blue, red green blue.", 16),
    (2, "Name a fruit.", 8),
    (4, "Write a Python function that adds two numbers.", 14),
    (1, "What is the capital of France?", 10),  # seeded sampling
]


@pytest.fixture(scope="module")
def smol_runner(smol_dir: Path) -> Any:
    from tl.runtime.runner import ModelRunner

    runner = ModelRunner.from_model_dir(BASE.replace(model_dir=str(smol_dir), speculative="prompt_lookup"))
    runner.warmup()
    return runner


@pytest.fixture(scope="module")
def arrivals(smol_dir: Path) -> list[Arrival]:
    from tl.text.chat_template import ChatTemplate
    from tl.text.tokenizer import Tokenizer

    tok, tpl = Tokenizer.load(smol_dir), ChatTemplate.from_model_dir(smol_dir)
    out = []
    for i, (step, q, n) in enumerate(QUESTIONS):
        ids = tuple(tok.encode(tpl.render([{"role": "user", "content": q}])))
        sampled = i == len(QUESTIONS) - 1
        params = SamplingParams(temperature=0.9 if sampled else 0.0, seed=7 if sampled else None, max_tokens=n)
        out.append(Arrival(step, GenRequest(ids, params)))
    return out


@pytest.mark.parametrize(
    "variant",
    [
        {"prefix_cache": "radix"},
        {"prefill_chunk": 16, "speculative": "prompt_lookup"},
        {"num_kv_blocks": 6, "prefix_cache": "radix", "prefill_chunk": 16, "speculative": "prompt_lookup"},
    ],
    ids=["prefix_cache", "chunked_speculative", "tiny_kv_everything"],
)
def test_smollm2_concurrent_equals_alone(smol_runner: Any, arrivals: list[Arrival], variant: dict[str, Any]) -> None:
    def factory(cfg: EngineConfig) -> Runner:
        return NarrowKV(smol_runner, cfg.num_kv_blocks)  # type: ignore[return-value]

    cfg = BASE.replace(**variant)
    compiled = smol_runner.num_compilations
    engine = assert_concurrent_equals_alone(factory, cfg, BASE, arrivals, check=check_engine)
    stats = engine.stats()
    assert stats.kv_blocks_used == 0
    assert smol_runner.num_compilations == compiled, "serving recompiled"
    if cfg.prefix_cache == "radix":
        assert stats.prefix_cache_hits > 0
    if cfg.num_kv_blocks == 6:
        assert stats.preemptions > 0
    if cfg.speculative == "prompt_lookup":
        assert stats.spec_drafts_accepted > 0
