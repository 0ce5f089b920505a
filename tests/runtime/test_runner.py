"""tl/runtime/runner.py on tiny random models: the paged, batched, bucketed step against the dense
no-cache forward; donation; a flat compile count after warm-up; drafts; seeds; embeddings;
loading from a model directory.

A small host-side driver plays the scheduler: non-contiguous blocks from a shuffled free list,
prompt chunks mixed with decodes in one step.
"""

from __future__ import annotations

import dataclasses
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers.models import TINY
from tests.helpers.runner import (
    ENGINE,
    GREEDY,
    Driver,
    Seq,
    _dense,
    dense_greedy,
    generate,
    make_runner,
)
from tl.core.plan import SchedulerOutput, SeqWork
from tl.core.request import SamplingParams
from tl.model import llama
from tl.model.embedding import dense_embedding
from tl.runtime.runner import ModelRunner
from tl.runtime.startup import start


@pytest.fixture(scope="module")
def runner_and_params() -> tuple[ModelRunner, dict]:
    """Warmed up once: the tests sharing it compile no step variant."""
    runner, params = make_runner()
    runner.warmup()
    return runner, params


def test_paged_batched_matches_dense(runner_and_params: tuple[ModelRunner, dict]) -> None:
    runner, params = runner_and_params
    rng = np.random.default_rng(0)
    cfg = runner.model_config
    # lengths: chunked prefills (12, 9 over chunks of 5) finish while others decode
    seqs = [Seq(i, rng.integers(0, cfg.vocab_size, n).tolist(), 6) for i, n in enumerate([12, 3, 9, 1])]
    Driver(runner, seed=1).run(seqs)
    for s in seqs:
        want, want_lp = dense_greedy(params, cfg, s.prompt, s.max_new)
        assert s.out == want
        assert np.allclose(s.logprobs, want_lp, atol=1e-4)


def test_kv_cache_is_donated(runner_and_params: tuple[ModelRunner, dict]) -> None:
    runner, _ = runner_and_params
    k_old, v_old = runner.kv_cache
    Driver(runner, seed=2).step([Seq(0, [1, 2, 3], 1)])
    assert k_old.is_deleted() and v_old.is_deleted()
    assert not runner.kv_cache[0].is_deleted()


def test_same_seed_same_tokens_whatever_the_batch(runner_and_params: tuple[ModelRunner, dict]) -> None:
    runner, _ = runner_and_params
    p = SamplingParams(temperature=1.0, top_p=0.95)
    alone = Seq(0, [5, 6, 7, 8], 5, p, seed=42)
    Driver(runner, seed=3).run([alone])
    others = [Seq(1, [9] * 11, 5, SamplingParams(temperature=0.8), seed=1), Seq(2, [3], 3, GREEDY)]
    again = Seq(0, [5, 6, 7, 8], 5, p, seed=42)
    Driver(runner, seed=4).run([others[0], again, others[1]])
    assert again.out == alone.out


def test_greedy_drafts_match_plain_greedy() -> None:
    engine = ENGINE.replace(speculative="prompt_lookup", num_speculative_tokens=2)
    runner, params = make_runner(engine, seed=5)
    prompt = [7, 8, 9, 10, 11]
    want, _ = dense_greedy(params, runner.model_config, prompt, 6)
    blocks = tuple(range(10, 0, -1))

    def step(start: int, toks: list[int], drafts: list[int]) -> tuple[tuple[int, ...], int]:
        w = SeqWork(0, tuple(toks + drafts), start, blocks, True, GREEDY, 0, 0, tuple(drafts))
        r = runner.execute(SchedulerOutput((w,))).results[0]
        return r.token_ids, r.num_accepted

    # prefill with both drafts right: 2 accepted + the bonus token
    assert step(0, prompt, want[:2]) == (tuple(want[:3]), 2)
    # next: first draft right, second wrong -> 1 accepted + correction
    wrong = (want[4] + 1) % runner.model_config.vocab_size
    assert step(len(prompt) + 2, [want[2]], [want[3], wrong]) == (tuple(want[3:5]), 1)


def dense_embed(runner: ModelRunner, ids: list[int]) -> list[float]:
    """The dense no-cache reference (tl/model/embedding.py) over the runner's placed weights."""
    return dense_embedding(runner.params, runner.model_config, ids, runner.plan.token_buckets, runner.max_model_len)


def test_compile_count_flat_after_warmup(runner_and_params: tuple[ModelRunner, dict]) -> None:
    from jax import monitoring

    runner, _ = runner_and_params
    assert list(runner.plan.variants) == [(8, 1), (8, 4), (32, 1), (32, 4)]
    warm = runner.num_compilations
    assert warm >= len(list(runner.plan.variants))
    compiles = []

    def listen(event: str, _duration: float, **_kw: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    monitoring.register_event_duration_secs_listener(listen)
    rng = np.random.default_rng(6)
    mixes = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_k=5, logprobs=True, top_logprobs=3),
        SamplingParams(temperature=1.0, top_p=0.8, min_p=0.1, frequency_penalty=0.5, logit_bias=((3, 2.0),)),
    ]
    for trial in range(6):
        seqs = [
            Seq(
                i,
                rng.integers(0, 160, int(rng.integers(1, 14))).tolist(),
                int(rng.integers(1, 5)),
                mixes[(i + trial) % 3],
                seed=i,
            )
            for i in range(int(rng.integers(1, 5)))
        ]
        Driver(runner, seed=trial, chunk=int(rng.integers(1, 9))).run(seqs)
        assert all(len(s.out) >= s.max_new for s in seqs)
    assert runner.num_compilations == warm
    assert compiles == []


def test_top_logprobs_and_logprob(runner_and_params: tuple[ModelRunner, dict]) -> None:
    runner, params = runner_and_params
    p = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)
    w = SeqWork(9, (1, 2, 3, 4, 5), 0, (30, 2), True, p, 0, 0)
    r = runner.execute(SchedulerOutput((w,))).results[0]
    _, logits = _dense(params, runner.model_config, jnp.asarray([1, 2, 3, 4, 5], jnp.int32))
    lp = np.asarray(jax.nn.log_softmax(logits[-1]))
    top = np.argsort(-lp)[:3]
    assert [t for t, _ in r.top_logprobs[0]] == top.tolist()
    assert np.allclose([v for _, v in r.top_logprobs[0]], lp[top], atol=1e-4)
    assert r.token_ids == (int(top[0]),) and abs(r.logprobs[0] - lp[top[0]]) < 1e-4


def test_penalties_reach_the_sampler(runner_and_params: tuple[ModelRunner, dict]) -> None:
    runner, _ = runner_and_params
    w = SeqWork(4, (1, 2, 3), 0, (41,), True, GREEDY, 0, 0)
    top = runner.execute(SchedulerOutput((w,))).results[0].token_ids[0]
    p = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    w = SeqWork(4, (1, 2, 3), 0, (41,), True, p, 0, 5, output_ids=(top,) * 5)
    assert runner.execute(SchedulerOutput((w,))).results[0].token_ids[0] != top


def test_prefill_chunk_without_sample_returns_nothing(runner_and_params: tuple[ModelRunner, dict]) -> None:
    runner, _ = runner_and_params
    w = SeqWork(3, (1, 2, 3), 0, (40,), False, GREEDY, 0, 0)
    assert runner.execute(SchedulerOutput((w,))).results == ()


def test_embed_is_padding_invariant_mean(runner_and_params: tuple[ModelRunner, dict]) -> None:
    runner, params = runner_and_params
    ids = [4, 8, 15, 16, 23]
    got = np.asarray(dense_embed(runner, ids))
    hidden, _ = _dense(params, runner.model_config, jnp.asarray(ids, jnp.int32))
    mean = np.asarray(hidden).mean(0)
    assert np.allclose(got, mean / np.linalg.norm(mean), atol=1e-5)
    assert np.isclose(np.linalg.norm(got), 1.0)
    assert len(dense_embed(runner, list(range(40)))) == runner.model_config.hidden_size  # past the largest bucket


def test_scheduled_embeddings_equal_embed_alone(runner_and_params: tuple[ModelRunner, dict]) -> None:
    """Embeddings inputs pooled by the step, in chunks of 8 beside a decoding stream and each
    other, equal ModelRunner.embed's (dense, no cache) vectors: cosine >= 0.99999."""
    from tl.core.engine import Engine
    from tl.core.request import EmbedRequest, GenRequest

    runner, _ = runner_and_params
    engine = Engine(runner, ENGINE.replace(prefill_chunk=8, prompt_tokens_while_decoding=12))
    rng = random.Random(5)
    inputs = tuple(tuple(rng.randrange(160) for _ in range(n)) for n in (1, 7, 8, 9, 30, 61))
    gen = engine.add_request(GenRequest((3, 1, 4, 1, 5), SamplingParams(temperature=0.0, max_tokens=20)))
    engine.step()
    ids = engine.add_embedding(EmbedRequest(inputs))
    got = {}
    while engine.has_work():
        got.update({o.request_id: o.embedding for o in engine.step() if o.request_id != gen})
    assert engine.stats().kv_blocks_used == 0
    for rid, x in zip(ids, inputs, strict=True):
        want = np.asarray(dense_embed(runner, list(x)))
        vec = np.asarray(got[rid])
        assert abs(np.linalg.norm(vec) - 1.0) < 1e-6
        assert float(vec @ want) >= 0.99999, (len(x), float(vec @ want))


def test_bfloat16_runs_with_bits_cache() -> None:
    runner, params = make_runner(ENGINE.replace(dtype="bfloat16"), seed=7)
    assert runner.kv_cache[0].dtype == jnp.uint16
    s = Seq(0, [1, 2, 3, 4, 5, 6], 4)
    Driver(runner).run([s])
    want, _ = dense_greedy(params, runner.model_config, s.prompt, 4)
    assert len(s.out) == 4 and sum(a == b for a, b in zip(s.out, want, strict=True)) >= 2


def test_logits_are_the_dense_forwards_and_what_execute_samples(runner_and_params: tuple[ModelRunner, dict]) -> None:
    runner, params = runner_and_params
    prompt = [3, 1, 4, 1, 5]
    plan = SchedulerOutput(
        (
            SeqWork(
                seq_id=0,
                token_ids=tuple(prompt),
                start_pos=0,
                block_table=(7, 2),
                sample=True,
                params=GREEDY,
                seed=0,
                num_generated=0,
            ),
        )
    )
    logits = runner.logits(plan)
    _, dense = _dense(params, runner.model_config, jnp.asarray(prompt + [0] * 3, jnp.int32))
    assert logits.shape == (1, runner.model_config.vocab_size)
    assert np.allclose(logits[0], np.asarray(dense)[len(prompt) - 1], atol=1e-4)
    res = runner.execute(plan).results[0]
    assert res.token_ids[0] == int(logits[0].argmax())
    assert np.isclose(res.logprobs[0], float(jax.nn.log_softmax(logits[0])[res.token_ids[0]]), atol=1e-4)


def test_bf16_kv_cache_of_a_float32_model() -> None:
    """kv_cache_dtype "bfloat16": float32 weights and activations, the cache as bf16 bits. The native
    kernel (head dim 64, block 16: its vector fold) and the reference read it alike; against the
    float32 cache only bf16 rounding differs."""
    cfg = dataclasses.replace(
        TINY, hidden_size=128, intermediate_size=192, num_attention_heads=2, num_key_value_heads=1, head_dim=64
    )

    params = jax.tree.map(np.asarray, llama.init_params(cfg, jax.random.key(3)))
    # "highest": the reference attention runs with XLA's float32 dot, so the native one must too
    engine = ENGINE.replace(block_size=16, num_kv_blocks=16, matmul_precision="highest")
    prompts = [[5, 9, 2, 77, 31, 8, 150, 4, 19, 60, 3], [7, 7, 1], [99] * 20]

    def run(**kw: object) -> tuple[ModelRunner, list[Seq]]:
        runner = ModelRunner(start(cfg, params, engine.replace(**kw)))
        return runner, generate(runner, prompts, 12)

    native, got = run(kv_cache_dtype="bfloat16", attention_kernel="cpu_native")  # forced: every step shape native
    assert native.kernels.attention.name == "cpu_native" and native.plan.compute_dtype == jnp.float32
    assert native.kv_cache[0].dtype == jnp.uint16 and native.backend_info.kv_cache_dtype == "bfloat16"
    _, ref = run(kv_cache_dtype="bfloat16", attention_kernel="reference")
    full, exact = run()
    assert native.kv_cache[0].nbytes * 2 == full.kv_cache[0].nbytes and full.backend_info.kv_cache_dtype == "float32"
    # what the card, /metrics and the start-up log say: keys and values of every layer, the
    # scratch block included (2 x layers x 17 blocks x 16 tokens x 1 head x 64), 4 or 2 bytes each
    values = 2 * cfg.num_hidden_layers * 17 * 16 * 1 * 64
    assert (full.backend_info.kv_cache_bytes, native.backend_info.kv_cache_bytes) == (4 * values, 2 * values)
    assert full.backend_info.kv_capacity_tokens == native.backend_info.kv_capacity_tokens == 16 * 16
    for a, b, c in zip(got, ref, exact, strict=True):
        # The native kernel reads a prompt token's earlier keys of its own step from the bf16
        # cache, as a decode of that token would (one arithmetic per token, issue 48); the
        # reference reads them as the step's float32 keys: bf16's rounding of those keys apart.
        assert a.out == b.out and np.allclose(a.logprobs, b.logprobs, atol=1e-2)
        assert np.allclose(a.logprobs, c.logprobs, atol=0.05)


def test_from_model_dir(succ_dir: object) -> None:
    from tl.model.files import eos_token_ids

    runner = ModelRunner.from_model_dir(ENGINE.replace(model_dir=str(succ_dir)))
    assert runner.eos_token_ids and runner.eos_token_ids == eos_token_ids(succ_dir)  # the Tokenizer's rule
    s = Seq(0, list(b"abc"), 4)
    Driver(runner).run([s])
    assert bytes(s.out) == b"defg"
