"""Several decode steps in one compiled call (EngineConfig.decode_steps) and the next call
launched before the current one's tokens reach the host (EngineConfig.overlap), each on and off,
on the real ModelRunner (tiny random Llama, CPU): every request gets exactly the tokens and
finish reason of one synchronous step per call, and its logprobs bit for bit, for
greedy, seeded, penalised, logprob, stop-token, end-of-sequence (stopped on the device),
max_tokens, preempted and aborted requests, with the block books exact.

One runner (decode_steps 4, its several-steps programs compiled) serves both engines: the
engine's decode_steps decides whether a call runs several steps. Its end-of-sequence id is a
token the tiny model is known to produce (by the numpy reference forward), so a row really is
stopped inside the call.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tests.helpers.differential import Arrival, drive, finish_reason, token_ids
from tests.helpers.engine_cases import NarrowKV, check_engine
from tl.core.config import EngineConfig
from tl.core.engine import Engine
from tl.core.request import GenRequest, SamplingParams, TokenOut

jax = pytest.importorskip("jax")

CFG = EngineConfig(
    block_size=4,
    num_kv_blocks=64,
    max_num_seqs=4,
    max_num_batched_tokens=8,
    token_buckets=(8,),
    seq_buckets=(1, 4),
    prefill_chunk=8,
    prefix_cache="none",
    speculative="none",
    max_logprobs=5,
    compile_cache_dir="",
    decode_steps=4,
    decode_steps_max_ms=1e6,
    overlap="off",
)
ONE = CFG.replace(decode_steps=1)
MODES = {"steps": {}, "steps_overlap": {"overlap": "on"}, "overlap": {"decode_steps": 1, "overlap": "on"}}
PROMPT = tuple(range(10, 22))


@pytest.fixture(scope="module")
def model() -> tuple[Any, Any]:
    import numpy as np

    from tests.helpers.models import tiny_config
    from tl.model import llama

    cfg = tiny_config()
    return cfg, jax.tree.map(np.asarray, llama.init_params(cfg, jax.random.key(0)))


@pytest.fixture(scope="module")
def eos(model: tuple[Any, Any]) -> int:
    """The third greedy token of PROMPT (not among the first two; by the numpy reference
    forward): the EOS id of `runner`."""
    from tests.helpers.numpy_llama import np_forward

    cfg, tensors = model
    ids = list(PROMPT)
    for _ in range(3):
        ids.append(int(np_forward(tensors, cfg, ids)[-1].argmax()))
    first = ids[len(PROMPT) :]
    assert first[2] not in first[:2], first
    return first[2]


@pytest.fixture(scope="module")
def runner(model: tuple[Any, Any], eos: int) -> Any:
    from tl.runtime.runner import ModelRunner
    from tl.runtime.startup import start

    r = ModelRunner(start(*model, CFG, eos=(eos,)))
    r.warmup()
    r.compile_several()
    r.feeds.background = False  # the programs feeding a call's tokens to the next: compiled when first needed
    assert r.several is not None and r.several.num_compiled == len(r.several.variants) > 0
    return r


def workload() -> list[Arrival]:
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    return [
        Arrival(0, GenRequest(PROMPT, greedy)),  # stops at the EOS id, inside a call
        Arrival(0, GenRequest(PROMPT, dataclasses.replace(greedy, ignore_eos=True, max_tokens=14))),  # decodes past it
        Arrival(0, GenRequest(tuple(range(40, 49)), SamplingParams(temperature=0.8, max_tokens=13, seed=7))),
        Arrival(
            1,
            GenRequest(
                tuple(range(60, 66)),
                SamplingParams(
                    temperature=0.9,
                    max_tokens=15,
                    seed=3,
                    frequency_penalty=0.7,
                    presence_penalty=0.4,
                    repetition_penalty=1.3,
                    ignore_eos=True,
                ),
            ),
        ),
        Arrival(6, GenRequest(tuple(range(30, 37)), dataclasses.replace(greedy, max_tokens=1))),
        Arrival(
            7,
            GenRequest(tuple(range(31, 37)), dataclasses.replace(greedy, max_tokens=2, logprobs=True, top_logprobs=3)),
        ),
        Arrival(
            9, GenRequest(tuple(range(70, 80)), dataclasses.replace(greedy, max_tokens=9, stop_token_ids=(0, 5, 77)))
        ),
        Arrival(12, GenRequest(tuple(range(20, 25)), SamplingParams(temperature=0.7, max_tokens=6, seed=11))),
    ]


def _books(engine: Engine) -> None:
    check_engine(engine)


def _same(a: list[TokenOut], b: list[TokenOut]) -> None:
    assert token_ids(a) == token_ids(b)
    assert [o.logprob for o in a] == [o.logprob for o in b]  # bit for bit: one arithmetic a row (issue 48)
    assert [[t for t, _ in o.top_logprobs] for o in a] == [[t for t, _ in o.top_logprobs] for o in b]
    assert [[v for _, v in o.top_logprobs] for o in a] == [[v for _, v in o.top_logprobs] for o in b]
    assert finish_reason(a) == finish_reason(b)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kv", [64, 14], ids=["roomy", "preempting"])
def test_several_steps_and_overlap_give_exactly_the_single_steps_outputs(
    runner: Any, eos: int, kv: int, mode: str
) -> None:
    cfg = CFG.replace(num_kv_blocks=kv, **MODES[mode])
    many = Engine(NarrowKV(runner, kv), cfg)  # type: ignore[arg-type]
    one = Engine(NarrowKV(runner, kv), ONE.replace(num_kv_blocks=kv))  # type: ignore[arg-type]
    drive(many, workload(), check=_books)  # once to measure each size's step: what several steps per call go by
    warm = many.stats()
    got = drive(many, workload(), check=_books)
    want = drive(one, workload(), check=_books)
    for a, b in zip(got, want, strict=True):
        _same(a, b)
    assert finish_reason(got[0]) == "stop" and token_ids(got[0])[-1] == eos and len(got[0]) == 3
    assert eos in token_ids(got[1]) and finish_reason(got[1]) == "length"
    s, s1 = many.stats(), one.stats()
    assert (s.multi_step_calls > warm.multi_step_calls) == (cfg.decode_steps > 1) and s1.multi_step_calls == 0
    assert (s.overlapped_steps > warm.overlapped_steps) == (cfg.overlap == "on") and s1.overlapped_steps == 0
    assert s.steps - warm.steps < s1.steps or cfg.decode_steps == 1
    assert (s.preemptions > 0) == (kv == 14), s
    assert (s.kv_blocks_used, s.running, s.queue_depth) == (0, 0, 0)


class _Ahead(NarrowKV):
    """The runner, noting how many sequences each call launched ahead follows."""

    def __init__(self, runner: Any, num_kv_blocks: int) -> None:
        super().__init__(runner, num_kv_blocks)
        self.after_sizes: list[int] = []

    @property
    def overlap(self) -> Any:
        return self

    def launch(self, plan: Any, after: Any = None) -> Any:
        if after is not None:
            self.after_sizes.append(len(after.plan.work))
        return self._runner.launch(plan, after)


def test_auto_overlap_on_a_cpu_launches_ahead_for_a_lone_sequence_only(runner: Any) -> None:
    """[engine] overlap "auto" on the CPU backend (runner.overlap_auto_seqs 1): a call is launched
    ahead only after a call of one sequence, never while two run; the tokens are the single
    steps' all the same."""
    assert runner.overlap_auto_seqs == 1
    cfg = CFG.replace(overlap="auto")
    lone = [Arrival(0, GenRequest(PROMPT, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)))]
    spy = _Ahead(runner, 64)
    many = Engine(spy, cfg)  # type: ignore[arg-type]
    one = Engine(NarrowKV(runner, 64), ONE)  # type: ignore[arg-type]
    drive(many, lone, check=_books)  # once to measure the step: what several steps per call go by
    warm = many.stats()
    _same(drive(many, lone, check=_books)[0], drive(one, lone, check=_books)[0])
    assert many.stats().overlapped_steps > warm.overlapped_steps and spy.after_sizes
    spy.after_sizes.clear()
    pair = [  # together for 6 tokens, then the second alone
        Arrival(0, GenRequest(PROMPT, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))),
        Arrival(0, GenRequest(tuple(range(40, 49)), SamplingParams(temperature=0.8, max_tokens=24, seed=7))),
    ]
    for a, b in zip(drive(many, pair, check=_books), drive(one, pair, check=_books), strict=True):
        _same(a, b)
    assert spy.after_sizes and set(spy.after_sizes) == {1}, spy.after_sizes
    assert (many.stats().kv_blocks_used, many.stats().running) == (0, 0)


@pytest.mark.parametrize("mode", list(MODES))
def test_an_abort_between_calls_frees_its_blocks_and_changes_no_other_request(runner: Any, mode: str) -> None:
    """With overlap the aborted row's next call is already launched: its token is dropped."""
    engine = Engine(runner, CFG.replace(**MODES[mode]))
    reqs = [r.request for r in workload()[1:4]]
    ids = [engine.add_request(r) for r in reqs]
    outs: dict[int, list[TokenOut]] = {i: [] for i in ids}
    while engine.stats().steps < 4:
        for o in engine.step():
            outs[o.request_id].append(o)
    held = engine.block_manager.num_used
    engine.abort(ids[1])
    assert engine.block_manager.num_used < held
    while engine.has_work():
        for o in engine.step():
            outs[o.request_id].append(o)
        check_engine(engine)
    assert outs[ids[1]][-1].finish_reason == "abort"
    assert engine.stats().kv_blocks_used == 0
    for i in (0, 2):  # tokens (a different batch shape moves logprobs by an ulp or so)
        alone = drive(Engine(runner, ONE), [Arrival(0, reqs[i])])[0]
        assert token_ids(outs[ids[i]]) == token_ids(alone)
        assert finish_reason(outs[ids[i]]) == finish_reason(alone)


def test_a_call_runs_only_as_many_steps_as_the_time_bound_allows(runner: Any) -> None:
    """decode_steps_max_ms below one measured step: every call runs one step."""
    engine = Engine(runner, CFG.replace(decode_steps_max_ms=1e-3))
    drive(engine, workload()[:3])
    assert engine.stats().multi_step_calls == 0
