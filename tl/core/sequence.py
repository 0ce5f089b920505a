"""Per-request mutable state, owned by the scheduler.

Owns: Sequence (known tokens = prompt + output, num_computed_tokens, status, priority and
arrival order, the request's seed, its constraint's matcher) and SeqStatus. Only tl/core/scheduler.py mutates a
Sequence; the engine and tests read it. KV block tables live in tl/core/block_manager.py, keyed
by seq_id, not here. Pure Python, no jax/numpy. Tested through tests/core/test_scheduler.py.

The one rule (vLLM v1): a sequence has num_tokens known tokens and num_computed_tokens of
them have KV in the cache; each step computes some of the difference. A prompt, a chunk
of it, a decode, the recompute after preemption and the rest after a prefix hit are all
that one rule.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tl.core.request import FinishReason, Guide, SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # holds no KV blocks
    RUNNING = "running"  # holds KV blocks for its computed tokens
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    priority: int
    arrival_s: float
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    started: bool = False  # has been scheduled at least once (the queue deadline no longer applies)
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache (TokenOut's)
    scheduled_s: float = 0.0  # the scheduler's clock at its first admission (TokenOut's); 0.0 until then
    decoding_s: float = 0.0  # the scheduler's clock when its first token was sampled; 0.0 until then
    finish_reason: FinishReason | None = None
    pool: bool = False  # an embeddings input: pooled, never sampled, its blocks never cached
    group: int = -1  # the request it belongs to (an embeddings request's inputs share one); -1: its own
    pooled: list[int] = field(default_factory=list)  # the pooled sum over its computed tokens (plan.POOL_BITS)
    guide: Guide | None = None  # its constraint's matcher: has consumed exactly its output tokens

    @property
    def request_key(self) -> int:
        """What the queue capacity counts: one per request, however many inputs it has."""
        return self.group if self.group >= 0 else -1 - self.seq_id

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def output_ids(self) -> tuple[int, ...]:
        return tuple(self.token_ids[len(self.prompt_ids) :])

    def order_key(self) -> tuple[int, int]:
        """Serving order: higher priority first, then arrival (seq ids grow with arrival)."""
        return (-self.priority, self.seq_id)
