"""`python -m bench fleet` (bench/fleet_bench.py) without its servers: a bad router or policy is one
error line naming the flag, and a round's summary adds what the replicas said (cached tokens
over prompt tokens, TTFT percentiles, turn 1 left out of the later TTFT). Its `router` is run by
tests/serve/test_routers.py against real replicas."""

from __future__ import annotations

import pytest

from bench.fleet_bench import Turn, _summary, run
from bench.load import RequestResult


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--routers", "nginx"], "--routers: unknown router 'nginx'"),
        (["--policies", "round_robin,least_busy"], "--policies: unknown policy 'least_busy'"),
    ],
)
def test_a_bad_router_or_policy_is_one_line_naming_the_flag(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        run(argv)
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def _turn(conv: int, turn: int, ttft: float, prompt: int, cached: int, error: str = "") -> Turn:
    r = RequestResult(t_start=10.0, chunk_times=[10.0 + ttft], usage_prompt_tokens=prompt, error=error)
    r.usage_cached_tokens = cached
    return Turn(r, conv, turn)


def test_a_rounds_summary_is_the_replicas_counts() -> None:
    turns = [
        _turn(0, 0, 0.4, 100, 0),
        _turn(0, 1, 0.1, 150, 96),
        _turn(1, 0, 0.5, 100, 48),
        _turn(1, 1, 0.2, 150, 144),
        _turn(1, 2, 9.0, 999, 999, error="HTTP 503"),  # left out of every sum
    ]
    s = _summary(turns)
    assert s["requests"] == 5 and s["errors"] == ["HTTP 503"]
    assert (s["prompt_tokens"], s["cached_tokens"]) == (500, 288)
    assert s["cached_share"] == pytest.approx(288 / 500)
    assert s["ttft_p50_ms"] == pytest.approx(300.0)  # 100, 200, 400, 500 ms: interpolated median
    assert s["ttft_p50_ms_after_turn_1"] == pytest.approx(150.0)  # 100 and 200 ms
