"""Differential helpers: run requests through an Engine, concurrently or alone, with any runner.

A RunnerFactory builds a Runner from an EngineConfig: FakeRunner.from_config here, and
ModelRunner.from_model_dir (tl/runtime/runner.py) for the tiny-model runs, so the same checks
(concurrent == alone, speculative == plain, cached == uncached) run on both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tl.core.config import EngineConfig
from tl.core.engine import Engine
from tl.core.plan import Runner
from tl.core.request import GenRequest, TokenOut

RunnerFactory = Callable[[EngineConfig], Runner]
EngineCheck = Callable[[Engine], None]


@dataclass(frozen=True, slots=True)
class Arrival:
    step: int  # added just before this step (0 = before the first)
    request: GenRequest


def drive(
    engine: Engine, arrivals: Sequence[Arrival], *, check: EngineCheck | None = None, max_steps: int = 5000
) -> list[list[TokenOut]]:
    """Add each request at its step and step until no work is left; TokenOuts per arrival."""
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i].step)
    index_of: dict[int, int] = {}
    outs: list[list[TokenOut]] = [[] for _ in arrivals]
    step = 0
    while pending or engine.has_work():
        while pending and arrivals[pending[0]].step <= step:
            i = pending.pop(0)
            index_of[engine.add_request(arrivals[i].request)] = i
        for out in engine.step():
            outs[index_of[out.request_id]].append(out)
        if check is not None:
            check(engine)
        step += 1
        assert step < max_steps, "engine did not finish"
    return outs


def token_ids(outs: Sequence[TokenOut]) -> list[int]:
    return [o.token_id for o in outs if o.token_id >= 0]


def finish_reason(outs: Sequence[TokenOut]) -> str | None:
    return outs[-1].finish_reason if outs else None


def run_alone(factory: RunnerFactory, cfg: EngineConfig, request: GenRequest) -> list[TokenOut]:
    engine = Engine(factory(cfg), cfg)
    return drive(engine, [Arrival(0, request)])[0]


def logprobs(outs: Sequence[TokenOut]) -> list[float]:
    return [o.logprob for o in outs if o.token_id >= 0]


def assert_concurrent_equals_alone(
    factory: RunnerFactory,
    cfg: EngineConfig,
    reference_cfg: EngineConfig,
    arrivals: Sequence[Arrival],
    check: EngineCheck | None = None,
    exact_logprobs: bool = True,
) -> Engine:
    """Every request gets exactly the tokens, logprobs (bit for bit, unless exact_logprobs is
    False) and finish reason it gets alone under reference_cfg.

    Requests must carry explicit seeds when sampled (temperature > 0). Returns the engine.
    """
    engine = Engine(factory(cfg), cfg)
    together = drive(engine, arrivals, check=check)
    for i, arrival in enumerate(arrivals):
        alone = run_alone(factory, reference_cfg, arrival.request)
        assert token_ids(together[i]) == token_ids(alone), f"request {i}: concurrent != alone"
        if exact_logprobs:
            assert logprobs(together[i]) == logprobs(alone), f"request {i}: logprobs concurrent != alone"
        assert finish_reason(together[i]) == finish_reason(alone), f"request {i}: finish reason differs"
        assert [o.finish_reason for o in together[i][:-1]] == [None] * (len(together[i]) - 1)
    return engine
