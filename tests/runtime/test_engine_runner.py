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

from tests.helpers.differential import assert_concurrent_equals_alone
from tests.helpers.engine_cases import CFG, NarrowKV, check_engine, greedy, run, workload
from tl.core.config import EngineConfig
from tl.core.engine import Engine
from tl.core.plan import Runner
from tl.core.request import GenRequest, TokenOut

jax = pytest.importorskip("jax")


@pytest.fixture(scope="module")
def runners() -> dict[str, Any]:
    import numpy as np

    from tests.helpers.models import tiny_config
    from tl.model import llama
    from tl.runtime.runner import ModelRunner
    from tl.runtime.startup import start
    from tl.text.grammar import fill_masks

    cfg = tiny_config()
    params = jax.tree.map(np.asarray, llama.init_params(cfg, jax.random.key(0)))
    out = {}
    for spec in ("none", "prompt_lookup"):
        runner = ModelRunner(start(cfg, params, CFG.replace(speculative=spec)), fill_masks=fill_masks)
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


def test_a_prefix_hit_is_reported_and_changes_no_token(runners: dict[str, Any]) -> None:
    """A request sharing 14 prompt tokens with a finished one reads their 3 whole 4-token
    blocks from the prefix cache: every TokenOut says num_cached_tokens 12 (the first's 0), and
    its tokens are those it gets with no cache at all."""
    shared = run(14, start=20)

    def outs(engine: Engine, prompt: tuple[int, ...]) -> list[TokenOut]:
        rid = engine.add_request(GenRequest(prompt, greedy(4)))
        got: list[TokenOut] = []
        while engine.has_work():
            got += [o for o in engine.step() if o.request_id == rid]
        return got

    cached = Engine(runners["none"], CFG.replace(prefix_cache="radix"))
    first, second = outs(cached, (*shared, 5)), outs(cached, (*shared, 6, 7, 8))
    assert [o.num_cached_tokens for o in first] == [0] * 4
    assert [o.num_cached_tokens for o in second] == [4 * (14 // 4)] * 4
    alone = outs(Engine(runners["none"], CFG), (*shared, 6, 7, 8))
    assert [o.token_id for o in second] == [o.token_id for o in alone]


def test_constraints_in_the_compiled_step(runners: dict[str, Any]) -> None:
    """The bitmask is an input of the compiled step: constrained requests (JSON Schema, regex,
    choice; greedy and sampled with top-k, top-p, min-p) follow their grammar on the tiny model,
    equal themselves alone with preemption, chunking and speculation, and nothing recompiles."""
    import json

    import jsonschema

    from tests.helpers.differential import Arrival, drive
    from tests.helpers.fake_engine import byte_grammars
    from tl.core.engine import Engine
    from tl.core.request import ConstraintSpec, GenRequest, SamplingParams

    grammars = byte_grammars(CFG)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "c": {"enum": ["ab", "ba"]}},
        "required": ["n", "c"],
        "additionalProperties": False,
    }
    specs = [
        ConstraintSpec("json", json.dumps(schema), "response_format"),
        ConstraintSpec("regex", "[a-c]{3,9}", "structured_outputs.regex"),
        ConstraintSpec("choice", json.dumps(["north", "south", "no"]), "structured_outputs.choice"),
    ]
    sampling = [
        SamplingParams(temperature=0.0, max_tokens=30),
        SamplingParams(temperature=1.0, top_k=5, max_tokens=30, seed=3),
        SamplingParams(temperature=0.8, top_p=0.7, min_p=0.05, max_tokens=30, seed=4),
    ]
    arrivals = [
        Arrival(i % 3, GenRequest(tuple(b"hi there " * (1 + i % 2)), p, constraint=grammars.compile(s).grammar))
        for i, (s, p) in enumerate((s, p) for s in specs for p in sampling)
    ]
    compiled = {k: r.num_compilations for k, r in runners.items()}

    def factory(cfg: EngineConfig) -> Runner:
        return NarrowKV(runners[cfg.speculative], cfg.num_kv_blocks)  # type: ignore[return-value]

    variant = {"num_kv_blocks": 14, "prefill_chunk": 4, "speculative": "prompt_lookup"}
    assert_concurrent_equals_alone(factory, CFG.replace(**variant), CFG, arrivals)
    engine = Engine(factory(CFG), CFG)
    for arrival, outs in zip(arrivals, drive(engine, arrivals), strict=True):
        assert outs[-1].finish_reason in ("stop", "length") and all(0 <= o.token_id < 256 for o in outs[:-1])
        text = bytes(o.token_id for o in outs if 0 <= o.token_id < 256).decode()
        kind = next(s.kind for s in specs if arrival.request.constraint.spec is s)  # type: ignore[union-attr]
        if outs[-1].finish_reason == "stop":
            if kind == "json":
                jsonschema.validate(json.loads(text), schema)
            elif kind == "choice":
                assert text in ("north", "south", "no")
            else:
                assert 3 <= len(text) <= 9 and set(text) <= set("abc")
    assert {k: r.num_compilations for k, r in runners.items()} == compiled
    masks = engine.stats().mask_seconds  # one observation per constrained sample row
    assert masks.count >= sum(len(o) for o in drive(Engine(factory(CFG), CFG), arrivals)) - len(arrivals)


def test_constrained_logprobs_are_the_constrained_distributions(runners: dict[str, Any]) -> None:
    """A choice of two words whose first bytes differ: the first token's top logprobs list only
    those two bytes, and their probabilities sum to 1."""
    import math

    from tests.helpers.differential import run_alone
    from tests.helpers.fake_engine import byte_grammars
    from tl.core.request import ConstraintSpec, GenRequest, SamplingParams

    g = byte_grammars(CFG).compile(ConstraintSpec("choice", '["yes", "no"]', "p")).grammar
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=True, top_logprobs=5)
    outs = run_alone(lambda cfg: runners["none"], CFG, GenRequest(tuple(b"answer: "), params, constraint=g))
    first = outs[0]
    assert {t for t, _ in first.top_logprobs} == {ord("y"), ord("n")}
    assert math.isclose(sum(math.exp(v) for _, v in first.top_logprobs), 1.0, rel_tol=1e-5)
    assert first.logprob == max(v for _, v in first.top_logprobs)
    assert all(len(o.top_logprobs) == 1 and math.isclose(o.logprob, 0.0, abs_tol=1e-6) for o in outs[1:-1])
