"""FakeRunner: a deterministic pure-Python Runner that checks every plan it is given.

It keeps a shadow KV cache: one slot per (block, offset) holding (position, token) as
written by earlier steps at the slots the block tables name. Next tokens are computed only
from what the shadow cache holds, so a wrong block table, a wrong start_pos, a block freed
while in use or a shared block overwritten gives wrong tokens (and usually an assertion
here first).

Rule: next = (last + 1 + [mix(context) % 5 == 0]) % vocab, where mix weighs every token by
its position: mostly the "succ" successor (so prompt lookup finds matching drafts) but
dependent on the whole context. Sampled requests (temperature > 0) add a pseudo-random
offset from (seed, num_generated + row), the key rule of tl/core/plan.py, so their output also
must not depend on batch neighbours, chunking or preemption. A draft is accepted while it
equals the rule's token at its row. Under a constraint (SeqWork.guide) the rule's token is
taken where the row's bitmask allows it, else the smallest allowed id (`pick_allowed`).
Several decode steps in one call (SeqWork.steps, `decode_steps` > 1) feed each token back at the
next position, as the real program does. `launch`/`collect` split `execute` as the real runner
does (the engine's overlap): a call launched after another takes its fed_back works' tokens from
that call's results, as the device does, and runs at once (writing its KV in launch order); a row
whose previous call stopped early (an end-of-sequence id inside several steps) computes nothing,
and must never be folded in.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from tl.core.config import EngineConfig
from tl.core.plan import POOL_BITS, Launched, RunnerOutput, SchedulerOutput, SeqResult, SeqWork
from tl.core.stats import BackendInfo


def mix(context: Sequence[int]) -> int:
    return sum((i + 1) * t for i, t in enumerate(context)) % 1_000_003


def _noise(seed: int, counter: int) -> int:
    x = (seed * 6364136223846793005 + counter * 1442695040888963407 + 1) % 2**64
    return (x >> 33) % 3


def next_token(context: Sequence[int], vocab_size: int, *, greedy: bool = True, seed: int = 0, counter: int = 0) -> int:
    """The rule, on a full context (prompt + tokens so far)."""
    token = (context[-1] + 1 + (mix(context) % 5 == 0)) % vocab_size
    return token if greedy else (token + _noise(seed, counter)) % vocab_size


def pool_vector(token: int, pos: int) -> tuple[float, float, float]:
    """The fake final hidden state of a token at a position."""
    return (1.0, float(token), float(pos))


def pooled_embedding(ids: Sequence[int]) -> list[float]:
    """What an embeddings input of these ids must come back as: the normalised mean of pool_vector."""
    mean = [sum(c) / len(ids) for c in zip(*(pool_vector(t, p) for p, t in enumerate(ids)), strict=True)]
    norm = sum(x * x for x in mean) ** 0.5
    return [x / norm for x in mean]


def pick_allowed(mask_row: np.ndarray, preferred: int, vocab_size: int) -> int:
    """The rule's token under a bitmask row (int32 words): `preferred` if allowed, else the
    smallest allowed id (what a constrained greedy pick is to this fake)."""
    bits = np.unpackbits(np.ascontiguousarray(mask_row).view(np.uint8), bitorder="little")[:vocab_size]
    if bits[preferred]:
        return preferred
    allowed = np.flatnonzero(bits)
    return int(allowed[0]) if len(allowed) else preferred


def logprob_of(token: int) -> float:
    return -0.125 * (token % 7)


class FakeRunner:
    def __init__(
        self,
        *,
        block_size: int = 4,
        num_kv_blocks: int = 64,
        max_model_len: int = 256,
        vocab_size: int = 97,
        eos_token_ids: tuple[int, ...] = (0,),
        decode_steps: int = 1,
        refuse_after: int = 0,
    ) -> None:
        """refuse_after k > 0: every k-th launch that follows another call returns None, as the
        real runner's does while the program feeding its tokens compiles."""
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.attention_window = 0
        self.backend_info: BackendInfo | None = None
        self.num_compilations = 0
        self.num_several_compilations = 0
        self.num_pending_compiles = 0
        self.closed = False
        self.kv: list[tuple[int, int] | None] = [None] * (num_kv_blocks * block_size)  # slot -> (position, token)
        self.history: dict[int, list[int]] = {}  # seq id -> tokens by position as committed so far (-1: unseen)
        self.plans: list[SchedulerOutput] = []
        self.max_decode_steps = decode_steps
        self.refuse_after = refuse_after
        self.follow_ups = 0  # launches that followed another call, refused ones included
        self.refused: list[SchedulerOutput] = []

    def decode_steps(self, num_seqs: int) -> int:
        """Several decode steps in one call, as the real runner's program runs them (SeqWork.steps)."""
        return self.max_decode_steps

    @classmethod
    def from_config(cls, cfg: EngineConfig, **kw: object) -> FakeRunner:
        return cls(
            block_size=cfg.block_size,
            num_kv_blocks=cfg.num_kv_blocks,
            max_model_len=cfg.max_model_len or 256,
            decode_steps=cfg.decode_steps,
            **kw,
        )  # type: ignore[arg-type]

    def slot(self, work: SeqWork, pos: int) -> int:
        return work.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def close(self) -> None:
        self.closed = True

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        self.plans.append(plan)
        self._check_plan(plan)
        for work in plan.work:  # every write lands before any read, as in one batched forward
            for i, token in enumerate(work.token_ids):
                self.kv[self.slot(work, work.start_pos + i)] = (work.start_pos + i, token)
        results = tuple(self._several(w) if w.steps > 1 else self._verify(w) for w in plan.work if w.sample)
        results += tuple(self._pool(w) for w in plan.work if w.pool)
        for work in plan.work:
            self._commit(work, next((r for r in results if r.seq_id == work.seq_id), None))
        return RunnerOutput(results)

    @property
    def overlap(self) -> FakeRunner:
        return self

    overlap_auto_seqs = 0  # [engine] overlap "auto" never launches ahead; "on" does

    def launch(self, plan: SchedulerOutput, after: Launched | None = None) -> Launched | None:
        run = plan
        if after is not None:
            self.follow_ups += 1
            if self.refuse_after and self.follow_ups % self.refuse_after == 0:
                self.refused.append(plan)
                return None
            assert isinstance(after.handle, RunnerOutput)
            made = {r.seq_id: r.token_ids for r in after.handle.results}
            prev = {w.seq_id: w for w in after.plan.work}
            works = []
            for w in plan.work:
                if not w.fed_back:  # a prompt admitted beside the fed-back decodes
                    works.append(w)
                    continue
                assert w.token_ids == (0,) and w.plain_decode, f"seq {w.seq_id}: not a fed-back decode"
                p = prev[w.seq_id]
                assert w.start_pos == p.start_pos + p.steps, f"seq {w.seq_id}: starts at {w.start_pos} after {p}"
                if w.params.has_penalties:  # the host's outputs: all but the previous call's (added on the device)
                    assert len(w.output_ids) == w.num_generated - p.steps, f"seq {w.seq_id}: stale output_ids"
                if len(made[w.seq_id]) < p.steps:
                    continue  # stopped inside the previous call: this row's token is never seen
                works.append(dataclasses.replace(w, token_ids=(made[w.seq_id][-1],), fed_back=False))
            run = dataclasses.replace(plan, work=tuple(works))
        else:
            assert not any(w.fed_back for w in plan.work), "fed-back work without the call it follows"
        return Launched(plan, 0.0, 0.0, 0.0, self.execute(run))

    def collect(self, launched: Launched) -> RunnerOutput:
        assert isinstance(launched.handle, RunnerOutput)
        return launched.handle

    def embed(self, token_ids: Sequence[int]) -> list[float]:
        return pooled_embedding(token_ids)

    def _pool(self, work: SeqWork) -> SeqResult:
        """The chunk's sum of pool_vector over its tokens, read back from the shadow cache (so a
        chunk pooled at the wrong positions or over another sequence's KV gives a wrong vector)."""
        assert not work.sample and not work.draft_ids, f"seq {work.seq_id}: a pooled work samples"
        context = self._context(work, work.start_pos + len(work.token_ids) - 1)  # every position's KV is there
        total = [0.0, 0.0, 0.0]
        for p in range(work.start_pos, len(context)):
            total = [a + b for a, b in zip(total, pool_vector(context[p], p), strict=True)]
        return SeqResult(work.seq_id, (), (), pooled=tuple(round(math.ldexp(x, POOL_BITS)) for x in total))

    def _context(self, work: SeqWork, pos: int) -> list[int]:
        """Tokens at positions 0..pos, read from the shadow cache through work's block table."""
        context = []
        for p in range(pos + 1):
            entry = self.kv[self.slot(work, p)]
            assert entry is not None and entry[0] == p, f"seq {work.seq_id}: no KV for position {p} (found {entry})"
            context.append(entry[1])
        return context

    def _verify(self, work: SeqWork) -> SeqResult:
        k = len(work.draft_ids)
        last = work.start_pos + len(work.token_ids) - 1
        out: list[int] = []
        masks = None
        if work.guide is not None:  # a constraint: row j's bitmask, as the real step gets it
            masks = np.zeros((k + 1, (self.vocab_size + 31) // 32), np.int32)
            work.guide.fill(masks, 0, work.draft_ids)
        for j in range(k + 1):
            context = self._context(work, last - k + j)
            token = next_token(
                context, self.vocab_size, greedy=work.params.greedy, seed=work.seed, counter=work.num_generated + j
            )
            if masks is not None:
                token = pick_allowed(masks[j], token, self.vocab_size)
            out.append(token)
            if j == k or token != work.draft_ids[j]:
                break
        return SeqResult(work.seq_id, tuple(out), tuple(logprob_of(t) for t in out), num_accepted=len(out) - 1)

    def _several(self, work: SeqWork) -> SeqResult:
        """work.steps decode steps in one call: each token the rule gives is fed back at the next
        position (its KV written there) until the row's limit or an EOS id (unless ignore_eos)."""
        assert work.steps <= self.max_decode_steps and work.plain_decode, f"seq {work.seq_id}: bad several steps"
        assert not work.draft_ids, f"seq {work.seq_id}: drafts in several steps"
        out: list[int] = []
        pos = work.start_pos
        for j in range(work.steps):
            token = next_token(
                self._context(work, pos),
                self.vocab_size,
                greedy=work.params.greedy,
                seed=work.seed,
                counter=work.num_generated + j,
            )
            out.append(token)
            if j + 1 == work.steps or (not work.params.ignore_eos and token in self.eos_token_ids):
                break
            pos += 1
            self.kv[self.slot(work, pos)] = (pos, token)
        return SeqResult(work.seq_id, tuple(out), tuple(logprob_of(t) for t in out), num_accepted=len(out) - 1)

    def _commit(self, work: SeqWork, result: SeqResult | None) -> None:
        fed = work.token_ids[: len(work.token_ids) - len(work.draft_ids)]
        accepted = work.draft_ids[: result.num_accepted] if result else ()
        if work.steps > 1 and result is not None:  # the tokens fed back on the device
            accepted = result.token_ids[: result.num_accepted]
        hist = self.history.setdefault(work.seq_id, [])[: work.start_pos]
        hist += [-1] * (work.start_pos - len(hist))  # positions first seen as a prefix-cache hit
        self.history[work.seq_id] = hist + list(fed) + list(accepted)

    def _check_plan(self, plan: SchedulerOutput) -> None:
        ids = [w.seq_id for w in plan.work]
        assert len(ids) == len(set(ids)), f"a sequence appears twice in one step: {ids}"
        written = {
            w.seq_id: {
                w.block_table[p // self.block_size]
                for p in range(w.start_pos, w.start_pos + max(len(w.token_ids), w.steps))
            }
            for w in plan.work
        }
        for w in plan.work:
            self._check_work(w)
            for other in plan.work:
                if other is not w:
                    shared = written[w.seq_id] & set(other.block_table)
                    assert not shared, f"seq {w.seq_id} writes blocks {shared} that seq {other.seq_id} holds"

    def _check_work(self, w: SeqWork) -> None:
        end = w.start_pos + max(len(w.token_ids), w.steps)
        assert w.token_ids and w.start_pos >= 0, f"seq {w.seq_id}: empty work or negative start"
        assert end <= self.max_model_len, f"seq {w.seq_id}: position {end - 1} beyond context {self.max_model_len}"
        assert len(w.block_table) * self.block_size >= end, f"seq {w.seq_id}: table {w.block_table} short of {end}"
        assert len(set(w.block_table)) == len(w.block_table), f"seq {w.seq_id}: block twice in {w.block_table}"
        assert all(0 <= b < self.num_kv_blocks for b in w.block_table), f"bad block id in {w.block_table}"
        if w.draft_ids:
            assert w.sample and w.token_ids[-len(w.draft_ids) :] == w.draft_ids, f"seq {w.seq_id}: bad drafts"
        hist = self.history.get(w.seq_id, [])
        for p in range(w.start_pos):
            entry = self.kv[self.slot(w, p)]
            assert entry is not None and entry[0] == p, f"seq {w.seq_id}: position {p} < start has no KV"
            if p < len(hist) and hist[p] >= 0:
                assert entry[1] == hist[p], f"seq {w.seq_id}: KV at {p} holds {entry[1]}, seq had {hist[p]}"
        fed = w.token_ids[: len(w.token_ids) - len(w.draft_ids)]
        for i, token in enumerate(fed):
            p = w.start_pos + i
            if p < len(hist) and hist[p] >= 0:
                assert hist[p] == token, f"seq {w.seq_id}: token at {p} changed from {hist[p]} to {token}"
