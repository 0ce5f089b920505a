"""Step costs: what one step of the engine took, by token bucket, and what a step will take.

Owns: the last measured seconds of a one-step call per token bucket (the padded token count the
runner computes: [engine] token_buckets), and `predict(num_tokens)`, the scheduler's estimate of
a step of that many tokens: its bucket's time if measured; else a straight line between the
nearest measured buckets below and above; else the nearest measured bucket above (a step costs no
more than a larger one); else the largest measured bucket below scaled up by tokens (too
high where steps are bound by reading the weights, which keeps the estimate on the safe side);
None before any step is measured. `predict_low` errs the other way, for the decodes' own step
(the base the budget is added to). The engine feeds it (tl/core/engine.py): one-step calls, and
each step of a call of several plain decodes (its time over its steps), leaving out calls during
which the runner compiled; the scheduler budgets prompt
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
        """Estimated seconds of one step of num_tokens tokens, on the high side where it must
        guess (None: nothing measured yet): what a step that adds prompt work will cost."""
        b = self.bucket(num_tokens)
        if b in self._seconds:
            return self._seconds[b]
        below, above = self._neighbours(b)
        if below is not None and above is not None:
            return self._line(b, below, above)
        if above is not None:
            return self._seconds[above]
        if below is not None:
            return self._seconds[below] * b / below
        return None

    def predict_low(self, num_tokens: int) -> float:
        """Estimated seconds of one step of num_tokens tokens, on the low side where it must
        guess: its bucket's, the line between measured neighbours, the nearest measured bucket
        below, or 0 (none measured at or below): what the decodes alone cost, the base the
        budget is added to (too high a base would let more prompt work in; too low only keeps
        steps small, and small steps are soon measured)."""
        b = self.bucket(num_tokens)
        if b in self._seconds:
            return self._seconds[b]
        below, above = self._neighbours(b)
        if below is None:
            return 0.0
        return self._seconds[below] if above is None else self._line(b, below, above)

    def _neighbours(self, b: int) -> tuple[int | None, int | None]:
        below = max((m for m in self._seconds if m < b), default=None)
        above = min((m for m in self._seconds if m > b), default=None)
        return below, above

    def _line(self, b: int, below: int, above: int) -> float:
        """Bucket b's time on the straight line between two measured buckets around it."""
        lo, hi = self._seconds[below], self._seconds[above]
        return lo + (hi - lo) * (b - below) / (above - below)
