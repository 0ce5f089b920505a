"""Step costs: what one step of the engine took, by token bucket, and what a step will take.

Owns: the last measured seconds of a one-step call per token bucket (the padded token count the
runner computes: [engine] token_buckets), and `predict(num_tokens)`, the scheduler's estimate of
a step of that many tokens: its bucket's time if measured; else a straight line between the
nearest measured buckets below and above; else the nearest measured bucket above (a step costs no
more than a larger one); else the largest measured bucket below scaled up by tokens (too
high where steps are bound by reading the weights, which keeps the estimate on the safe side);
None before any step is measured. The engine feeds it (tl/core/engine.py), leaving out calls of
several decode steps and calls during which the runner compiled; the scheduler budgets prompt
work beside decodes with it (tl/core/scheduler.py, [engine] prompt_ms_while_decoding). The last
time, not an average: a step's cost grows with its sequences' context, and the next step is
most like the last. Pure Python. Tested by tests/core/test_step_costs.py.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence


class StepCosts:
    def __init__(self, token_buckets: Sequence[int]) -> None:
        self._buckets = tuple(sorted(token_buckets))
        self._seconds: dict[int, float] = {}  # bucket -> last measured seconds

    def bucket(self, num_tokens: int) -> int:
        """The padded token count of a step of num_tokens (num_tokens itself above the last bucket)."""
        i = bisect.bisect_left(self._buckets, num_tokens)
        return self._buckets[i] if i < len(self._buckets) else num_tokens

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A one-step call of num_tokens tokens took `seconds` (no compile in it)."""
        if num_tokens > 0 and seconds > 0:
            self._seconds[self.bucket(num_tokens)] = seconds

    def predict(self, num_tokens: int) -> float | None:
        """Estimated seconds of one step of num_tokens tokens (None: nothing measured yet)."""
        b = self.bucket(num_tokens)
        if b in self._seconds:
            return self._seconds[b]
        below = max((m for m in self._seconds if m < b), default=None)
        above = min((m for m in self._seconds if m > b), default=None)
        if below is not None and above is not None:
            lo, hi = self._seconds[below], self._seconds[above]
            return lo + (hi - lo) * (b - below) / (above - below)
        if above is not None:
            return self._seconds[above]
        if below is not None:
            return self._seconds[below] * b / below
        return None
