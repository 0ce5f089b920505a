"""A tiny random-weight ModelRunner and a host-side driver that plays the scheduler, for the runtime
tests: the engine config of few buckets (ENGINE), make_runner, the dense no-cache greedy reference, and
Seq/Driver/generate (non-contiguous blocks from a shuffled free list, prompt chunks mixed with decodes),
runner_greedy (one prompt through a runner, greedy). The tiny config is tests/helpers/models.py's.
Used by tests/runtime/, tests/model/ and tests/kernels/ tests; must hold no tests."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from tests.helpers.models import tiny_cfg
from tl.core.config import EngineConfig
from tl.core.plan import SchedulerOutput, SeqWork
from tl.core.request import SamplingParams
from tl.model import llama, loader
from tl.model.config import ModelConfig
from tl.runtime.runner import ModelRunner
from tl.runtime.startup import start

GREEDY = SamplingParams(temperature=0.0)


# few buckets: every step variant costs seconds of XLA compile on a 2-core CPU
ENGINE = EngineConfig(
    token_buckets=(8, 32),
    seq_buckets=(1, 4),
    num_kv_blocks=64,
    block_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    max_logprobs=5,
    compile_cache_dir="",
)


def make_runner(engine: EngineConfig = ENGINE, seed: int = 0, **cfg_kw: object) -> tuple[ModelRunner, dict]:
    cfg = tiny_cfg(**cfg_kw)  # type: ignore[arg-type]
    params = jax.tree.map(np.asarray, llama.init_params(cfg, jax.random.key(seed)))
    return ModelRunner(start(cfg, params, engine)), params


_dense_jit = jax.jit(llama.forward_dense, static_argnums=1)


def _dense(params: dict | llama.Weights, cfg: ModelConfig, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The dense forward of Hugging Face tensors (or host Weights)."""
    weights = params
    if isinstance(params, dict):
        weights = loader.load_weights(params, cfg, np.dtype(next(iter(params.values())).dtype))
    return _dense_jit(weights, cfg, ids)


def dense_greedy(
    params: dict | llama.Weights, cfg: ModelConfig, prompt: list[int], n: int
) -> tuple[list[int], list[float]]:
    """Greedy loop over the dense forward of Hugging Face tensors (or Weights) `params`; inputs
    padded at the end to 64 (causal: no effect), one compile."""
    ids, lps = list(prompt), []
    for _ in range(n):
        _, logits = _dense(params, cfg, jnp.asarray(ids + [0] * (64 - len(ids)), jnp.int32))
        lp = jax.nn.log_softmax(logits[len(ids) - 1])
        ids.append(int(jnp.argmax(lp)))
        lps.append(float(lp[ids[-1]]))
    return ids[len(prompt) :], lps


@dataclass
class Seq:
    seq_id: int
    prompt: list[int]
    max_new: int
    params: SamplingParams = GREEDY
    seed: int = 0
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    computed: int = 0
    blocks: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    @property
    def done(self) -> bool:
        return len(self.out) >= self.max_new


class Driver:
    """A toy scheduler: chunked prefill (chunk tokens per step), then decodes; shuffled blocks."""

    def __init__(self, runner: ModelRunner, seed: int = 0, chunk: int = 5) -> None:
        self.runner, self.chunk = runner, chunk
        self.free = list(range(runner.num_kv_blocks))
        random.Random(seed).shuffle(self.free)

    def work(self, s: Seq) -> SeqWork:
        n = min(self.chunk, len(s.prompt) - s.computed) if s.computed < len(s.prompt) else 1
        end = s.computed + n
        while len(s.blocks) * self.runner.block_size < end:
            s.blocks.append(self.free.pop())
        return SeqWork(
            seq_id=s.seq_id,
            token_ids=tuple(s.tokens[s.computed : end]),
            start_pos=s.computed,
            block_table=tuple(s.blocks),
            sample=end >= len(s.prompt),
            params=s.params,
            seed=s.seed,
            num_generated=len(s.out),
        )

    def step(self, seqs: list[Seq]) -> None:
        live = [s for s in seqs if not s.done]
        plan = SchedulerOutput(tuple(self.work(s) for s in live))
        results = {r.seq_id: r for r in self.runner.execute(plan).results}
        for s, w in zip(live, plan.work, strict=True):
            s.computed += len(w.token_ids)
            if w.sample:
                s.out += results[s.seq_id].token_ids
                s.logprobs += results[s.seq_id].logprobs

    def run(self, seqs: list[Seq]) -> None:
        while not all(s.done for s in seqs):
            self.step(seqs)


def generate(runner: ModelRunner, prompts: list[list[int]], max_tokens: int, chunk: int = 5) -> list[Seq]:
    """Each prompt run to max_tokens greedy tokens through a Driver (sequence i has seq_id i)."""
    seqs = [Seq(i, p, max_tokens) for i, p in enumerate(prompts)]
    Driver(runner, chunk=chunk).run(seqs)
    return seqs


def runner_greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    ids, out, start = list(prompt), [], 0
    for _ in range(n):
        w = SeqWork(
            seq_id=0,
            token_ids=tuple(ids[start:]),
            start_pos=start,
            block_table=tuple(range(8)),
            sample=True,
            params=GREEDY,
            seed=0,
            num_generated=len(out),
        )
        tok = runner.execute(SchedulerOutput((w,))).results[0].token_ids[0]
        start = len(ids)
        ids.append(tok)
        out.append(tok)
    return out
