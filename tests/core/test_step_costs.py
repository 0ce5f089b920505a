"""The time bound on prompt work beside decodes ([engine] prompt_ms_while_decoding): StepCosts'
estimates (high for a step that adds prompt work, low for the decodes' own) by hand, and the
engine over a FakeRunner whose steps cost a scripted time on a fake timer (cost proportional to
the token bucket, at two model sizes): every step that carries a decode stays within the
decodes' own step plus the budget, or the next bucket up; prompts progress; a step during which
the runner compiled is not taken as a measurement; and the tokens are those of each request
alone."""

from __future__ import annotations

import pytest

from tests.helpers.differential import Arrival, drive, token_ids
from tests.helpers.engine_cases import BASE_CFG, check_engine, greedy, run
from tests.helpers.fake_runner import FakeRunner
from tl.core.config import EngineConfig
from tl.core.engine import Engine
from tl.core.plan import RunnerOutput, SchedulerOutput
from tl.core.request import GenRequest
from tl.core.step_costs import StepCosts


def test_estimates_measured_interpolated_bounded_and_scaled() -> None:
    costs = StepCosts((4, 8, 16, 32, 64))
    assert costs.predict(5) is None and costs.predict_low(5) == 0.0  # nothing measured
    costs.observe(3, 0.2)  # bucket 4
    assert costs.predict(1) == 0.2 and costs.predict(4) == 0.2
    assert costs.predict(20) == pytest.approx(0.2 * 32 / 4)  # only below: scaled by tokens
    costs.observe(64, 1.0)
    assert costs.predict(7) == pytest.approx(0.2 + 0.8 * (8 - 4) / (64 - 4))  # between 4 and 64
    assert costs.predict(100) == pytest.approx(1.0 * 100 / 64)  # above the last bucket: its own size
    costs.observe(50, 0.5)  # the last time, not an average
    assert costs.predict(64) == 0.5
    costs.observe(10, 0.0)  # nothing to learn from
    assert costs.predict(16) == pytest.approx(0.2 + 0.3 * 12 / 60)
    assert costs.predict_low(16) == costs.predict(16)  # between measured buckets: the same line
    only_above = StepCosts((4, 8, 16))
    only_above.observe(16, 0.3)
    assert only_above.predict(2) == 0.3  # a step costs no more than a larger one
    assert only_above.predict_low(2) == 0.0  # but nothing says how little
    only_below = StepCosts((4, 8, 16))
    only_below.observe(4, 0.1)
    assert only_below.predict(16) == pytest.approx(0.4) and only_below.predict_low(16) == 0.1


class TimedRunner(FakeRunner):
    """A FakeRunner whose step of n tokens advances the fake timer by seconds_per_token times
    n's token bucket; `compile_at`: the plan indices during which it also compiles for 5 s."""

    def __init__(self, cfg: EngineConfig, seconds_per_token: float, compile_at: frozenset[int] = frozenset()) -> None:
        super().__init__(block_size=cfg.block_size, num_kv_blocks=cfg.num_kv_blocks, max_model_len=256)
        self.now = 0.0
        self.buckets = StepCosts(cfg.token_buckets)
        self.seconds_per_token = seconds_per_token
        self.compile_at = compile_at
        self.took: list[float] = []

    def cost(self, num_tokens: int) -> float:
        return self.seconds_per_token * self.buckets.bucket(num_tokens)

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        took = self.cost(plan.num_tokens)
        if len(self.plans) in self.compile_at:
            self.num_compilations += 1
            took += 5.0
        self.now += took
        self.took.append(took)
        return super().execute(plan)


CFG = BASE_CFG.replace(
    token_buckets=(4, 8, 16, 32, 64),
    max_num_batched_tokens=64,
    prefill_chunk=64,
    prompt_tokens_while_decoding=0,  # the token cap off: the time bound alone
    prompt_ms_while_decoding=50.0,
)


def _arrivals(second_at: int) -> list[Arrival]:
    return [Arrival(0, GenRequest(run(30), greedy(30))), Arrival(second_at, GenRequest(run(60, 100), greedy(4)))]


def _drive(
    cfg: EngineConfig, seconds_per_token: float, compile_at: frozenset[int] = frozenset(), second_at: int = 3
) -> TimedRunner:
    runner = TimedRunner(cfg, seconds_per_token, compile_at)
    engine = Engine(runner, cfg, timer=lambda: runner.now)
    arrivals = _arrivals(second_at)
    got = drive(engine, arrivals, check=check_engine)
    for arrival, outs in zip(arrivals, got, strict=True):  # each request's tokens are its own alone
        alone = drive(Engine(FakeRunner.from_config(cfg), cfg), [Arrival(0, arrival.request)])[0]
        assert token_ids(outs) == token_ids(alone)
    assert engine.stats().kv_blocks_used == 0
    return runner


def _mixed(runner: TimedRunner) -> list[tuple[int, int, float]]:
    """(decode tokens, prompt tokens, seconds) of each step that carried decodes and prompt work."""
    out = []
    for plan, took in zip(runner.plans, runner.took, strict=True):
        decodes = sum(len(w.token_ids) for w in plan.work if w.plain_decode)
        if decodes and plan.num_prompt_tokens:
            out.append((decodes, plan.num_prompt_tokens, took))
    return out


@pytest.mark.parametrize("second_at", [1, 3], ids=["before_any_decode_is_measured", "after"])
@pytest.mark.parametrize("seconds_per_token", [0.01, 0.1], ids=["small_model", "model_ten_times_larger"])
def test_a_decodes_gap_stays_within_its_step_plus_the_budget(seconds_per_token: float, second_at: int) -> None:
    """Arriving at step 1, the second prompt meets a decode whose step was never measured (only
    the first prompt's 32-token step was): the least goes beside it, and is measured."""
    runner = _drive(CFG, seconds_per_token, second_at=second_at)
    mixed = _mixed(runner)
    assert sum(p for _, p, _ in mixed) >= 59  # the second prompt was computed beside the decodes
    budget = CFG.prompt_ms_while_decoding / 1000
    for decodes, prompt, took in mixed:
        own, next_up = runner.cost(decodes), runner.cost(runner.buckets.bucket(decodes) + 1)
        assert took <= max(own + budget, next_up) + 1e-9, (decodes, prompt, took)
    # the small model takes more than the least beside its decode (bucket 8: 40 ms more than bucket 4);
    # the large one only the least (bucket 4 beside one decode: 3 prompt tokens a step)
    assert max(p for _, p, _ in mixed) == (7 if seconds_per_token == 0.01 else 3)


def test_without_the_time_bound_the_gap_is_the_whole_prompt() -> None:
    """What the bound prevents: with neither bound, the second prompt goes in one 64-token step."""
    runner = _drive(CFG.replace(prompt_ms_while_decoding=0.0), 0.01)
    assert max(took for _, _, took in _mixed(runner)) == pytest.approx(0.64)


def test_a_generous_budget_takes_the_whole_prompt_at_once() -> None:
    runner = _drive(CFG.replace(prompt_ms_while_decoding=1000.0), 0.01)
    assert [p for _, p, _ in _mixed(runner)] == [60]


def test_both_bounds_apply_the_lower_wins() -> None:
    runner = _drive(CFG.replace(prompt_tokens_while_decoding=2, prompt_ms_while_decoding=1000.0), 0.01)
    assert max(p for _, p, _ in _mixed(runner)) == 3  # 1 decode + 2 -> bucket 4, filled


def test_a_step_that_compiled_is_not_a_measurement() -> None:
    """The first decode step (plan 1) also compiles for 5 s: taken as the decode's cost, it would
    let the whole prompt in beside it; left out, the budget holds as without the compile."""
    runner = _drive(CFG, 0.01, compile_at=frozenset({1}))
    assert max(p for _, p, _ in _mixed(runner)) == 7


def test_the_budget_is_checked_in_the_config() -> None:
    from tl.core.config import ConfigError

    with pytest.raises(ConfigError, match="prompt_ms_while_decoding"):
        EngineConfig(prompt_ms_while_decoding=-1.0)


def test_a_burst_takes_the_full_budget_beside_its_own_streams_and_a_later_prompt_the_bounded_one() -> None:
    """Three prompts arrive together (60 tokens each: one a 64-token step) and a fourth once
    they all stream. The burst's second and third go at the full budget beside the first ones'
    decodes (they arrived before any of those had its first token); the fourth arrives while
    they stream: bounded as ever (the cadence's 7 tokens beside the decodes)."""
    runner = TimedRunner(CFG, 0.01)
    engine = Engine(runner, CFG, clock=lambda: runner.now, timer=lambda: runner.now)
    burst = [Arrival(0, GenRequest(run(60, 10 * i), greedy(12))) for i in range(3)]
    got = drive(engine, [*burst, Arrival(4, GenRequest(run(60, 200), greedy(4)))], check=check_engine)
    first = [
        next(i for i, p in enumerate(runner.plans) if any(w.seq_id == s and w.sample for w in p.work)) for s in range(3)
    ]
    assert first == [0, 1, 2]  # one budget a step, streams or not
    late = [sum(len(w.token_ids) for w in p.work if w.seq_id == 3 and not w.plain_decode) for p in runner.plans[4:]]
    assert 0 < max(late) <= 7 and sum(late) == 60
    assert all(len(token_ids(outs)) == n for outs, n in zip(got, (12, 12, 12, 4), strict=True))
    assert engine.stats().kv_blocks_used == 0
