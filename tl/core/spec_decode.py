"""Prompt-lookup draft proposer for speculative decoding.

Owns: choosing draft tokens for one sequence from its own tokens (prompt + output), by
n-gram match. Does not verify drafts (the runner does) nor roll back KV (the scheduler
does, by advancing num_computed_tokens only over accepted tokens). Pure Python, no
jax/numpy. Tested by tests/core/test_scheduler.py (proposals) and the differential tests in
tests/core/test_engine.py (greedy output identical with and without speculation).
"""

from __future__ import annotations

from collections.abc import Sequence


class PromptLookupProposer:
    """Drafts = the tokens that followed the latest earlier occurrence of the sequence's
    last n tokens, trying n from max_n down to min_n."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], num_drafts: int) -> tuple[int, ...]:
        if num_drafts <= 0:
            return ()
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            start = _latest_match(token_ids, n)
            if start >= 0:
                return tuple(token_ids[start + n : start + n + num_drafts])
        return ()


def _latest_match(token_ids: Sequence[int], n: int) -> int:
    """Start of the latest occurrence of the last n tokens that is not the suffix itself; -1 if none."""
    suffix = list(token_ids[-n:])
    last = suffix[-1]
    for end in range(len(token_ids) - 2, n - 2, -1):  # end = index of the match's last token
        if token_ids[end] == last and list(token_ids[end - n + 1 : end + 1]) == suffix:
            return end - n + 1
    return -1
