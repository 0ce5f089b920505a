"""tl/runtime/compiler.py: which compiled variant runs a step, start-up then background compilation,
and (on the tiny model) that a step run in a larger variant than its own gives the same tokens
and compiles nothing."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

from tests.helpers.models import tiny_cfg
from tests.helpers.runner import ENGINE, Driver, Seq, make_runner
from tl.core.request import SamplingParams
from tl.model import llama
from tl.runtime.compiler import StepCompiler, compiling_now
from tl.runtime.execution import startup_variants, step_variants
from tl.runtime.startup import start

VARIANTS = [(1, 1), (4, 1), (4, 4), (8, 1), (8, 4), (16, 4)]


def test_pick_takes_the_smallest_compiled_variant_that_holds_the_step_while_compiling() -> None:
    made: list[tuple[int, int]] = []
    gate = threading.Event()

    def compile(v: tuple[int, int]) -> str:
        if v == (4, 1) and len(made) >= 2:
            gate.wait(10)  # the background compilation holds here
        made.append(v)
        return f"fn{v}"

    c = StepCompiler(compile, VARIANTS)
    c.compile_startup([(1, 1), (16, 4)])
    assert sorted(made) == [(1, 1), (16, 4)]
    c.start_background()
    assert c.compiling
    assert c.pick(1, 1) == ((1, 1), "fn(1, 1)")
    assert c.pick(4, 4) == ((16, 4), "fn(16, 4)")  # its own is not compiled: the larger one, no compile
    assert c.pick(8, 4) == ((16, 4), "fn(16, 4)")
    assert c.pick(32, 4) == ((32, 4), "fn(32, 4)") and made[-1] == (32, 4)  # nothing holds it: compiled now
    gate.set()
    assert c.wait(10) and not c.compiling
    assert c.pick(4, 1) == ((4, 1), "fn(4, 1)") and c.pick(8, 4) == ((8, 4), "fn(8, 4)")


def test_without_background_compilation_a_step_compiles_its_own_variant() -> None:
    """No warm-up asked for (the CLI's one-shot generate, benchmarks timing each variant): a
    step never borrows a larger variant; its own compiles on first use."""
    made: list[tuple[int, int]] = []
    c = StepCompiler(lambda v: made.append(v) or f"fn{v}", VARIANTS)
    assert c.pick(16, 4) == ((16, 4), "fn(16, 4)")
    assert c.pick(1, 1) == ((1, 1), "fn(1, 1)") and made == [(16, 4), (1, 1)]


def test_background_compiles_one_sequence_variants_first_and_stops() -> None:
    made: list[tuple[int, int]] = []
    gate = threading.Event()

    def compile(v: tuple[int, int]) -> str:
        if v == (8, 1):
            gate.wait(10)
        made.append(v)
        return str(v)

    c = StepCompiler(compile, VARIANTS)
    c.compile_startup([(1, 1), (16, 4)])
    c.start_background()
    assert not c.wait(0.2)  # held at (8, 1)
    assert c.pick(8, 4)[0] == (16, 4)  # meanwhile a step runs in the larger variant
    gate.set()
    assert c.wait(10)
    assert made[2:] == [(4, 1), (8, 1), (4, 4), (8, 4)] and c.compiled == tuple(VARIANTS)  # one sequence first
    stopped = StepCompiler(compile, VARIANTS)
    stopped.stop()
    stopped.compile_rest()
    assert stopped.num_compiled == 0


def test_stop_without_waiting_ends_the_background_after_the_variant_in_progress() -> None:
    gate = threading.Event()

    def compile(v: tuple[int, int]) -> str:
        if v == (4, 1):
            gate.wait(10)
        return str(v)

    c = StepCompiler(compile, VARIANTS)
    c.compile_startup([(1, 1), (16, 4)])
    c.start_background()
    c.stop(wait=False)  # returns at once, with (4, 1) still compiling
    assert c.compiling
    gate.set()
    assert c.wait(10) and c.compiled == ((1, 1), (4, 1), (16, 4))  # nothing after the one in progress


def test_a_background_failure_is_kept_and_steps_run_in_what_compiled() -> None:
    def compile(v: tuple[int, int]) -> str:
        if v == (4, 4):
            raise RuntimeError("boom")
        return str(v)

    c = StepCompiler(compile, VARIANTS)
    c.compile_startup([(1, 1), (16, 4)])
    c.start_background()
    assert c.wait(10)
    assert isinstance(c.background_error, RuntimeError) and c.pick(4, 4)[0] == (16, 4)


def test_requested_variants_compile_in_order_once_after_the_other_compilation() -> None:
    """Several decode steps' variants: compiled when first asked for, each once, in the order
    asked, on one daemon thread that waits while the step variants' compilation runs."""
    made: list[tuple[int, int]] = []
    busy = threading.Event()
    busy.set()

    def compile(v: tuple[int, int]) -> str:
        made.append(v)
        return f"fn{v}"

    c = StepCompiler(compile, VARIANTS)
    for v in [(8, 4), (1, 1), (8, 4)]:
        c.request(v, wait_while=busy.is_set)
    assert c.num_requested_pending == 2
    threading.Event().wait(0.3)
    assert made == []  # held while the other compilation runs
    busy.clear()
    for _ in range(100):
        if c.num_requested_pending == 0:
            break
        threading.Event().wait(0.05)
    assert made == [(8, 4), (1, 1)] and c.compiled == ((1, 1), (8, 4))
    c.request((8, 4), wait_while=busy.is_set)  # compiled already: nothing more
    c.request((4, 1), wait_while=busy.is_set)
    for _ in range(100):
        if c.num_requested_pending == 0:
            break
        threading.Event().wait(0.05)
    assert made == [(8, 4), (1, 1), (4, 1)]
    c.stop()


def test_compiling_now_is_true_only_while_a_variant_compiles() -> None:
    """What a multi-host peer's heartbeat reports (tl/entry/build.py passes it to both ends)."""
    seen: list[bool] = []

    def compile(v: tuple[int, int]) -> str:
        seen.append(compiling_now())
        return str(v)

    c = StepCompiler(compile, VARIANTS)
    assert not compiling_now()
    c.warm_up([(1, 1), (16, 4)])
    assert seen == [True] * len(VARIANTS) and not compiling_now() and c.num_compiled == len(VARIANTS)


def test_plan_variants_and_startup_set() -> None:
    v = step_variants(ENGINE)
    assert v == ((8, 1), (8, 4), (32, 1), (32, 4))
    assert startup_variants(v) == ((8, 1), (32, 4))


@pytest.fixture(scope="module")
def two_runners() -> tuple:
    full, _ = make_runner(ENGINE, seed=11)
    part, _ = make_runner(ENGINE, seed=11)
    full.warmup()
    part.compiler.compile_startup(part.plan.startup_variants)  # (8, 1) and (32, 4) only
    part.compiler.borrowing = True  # as while the background compilation runs
    return full, part


def test_steps_in_a_larger_variant_give_the_same_tokens(two_runners: tuple) -> None:
    full, part = two_runners
    assert part.compiler.compiled == ((8, 1), (32, 4))
    compiled = part.num_compilations
    rng = np.random.default_rng(3)
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=7, top_p=0.9)
    prompts = [rng.integers(0, 160, int(rng.integers(2, 12))).tolist() for _ in range(3)]
    outs = []
    for r in (full, part):
        seqs = [Seq(i, list(p), 6, greedy if i % 2 else sampled, seed=i) for i, p in enumerate(prompts)]
        Driver(r, seed=5, chunk=5).run(seqs)
        outs.append([s.out for s in seqs])
    assert outs[0] == outs[1]
    assert part.num_compilations == compiled  # (8, 4) steps ran in (32, 4): nothing compiled


def test_a_background_start_compiles_one_sequences_several_steps_program_before_ready() -> None:
    """A server's start-up (warmup "background") compiles one sequence's several-decode-steps
    program before it returns, unasked: a lone request's first decodes run several steps a call
    from the start, not one a call until the background compiles are done. Other sequence
    counts' wait for a step to ask; a start-up that compiles everything now ("all": tests,
    benchmarks) compiles none."""
    cfg = tiny_cfg()
    params = jax.tree.map(np.asarray, llama.init_params(cfg, jax.random.key(0)))
    started = start(cfg, params, ENGINE, warmup="background")
    assert started.several is not None
    try:
        one = started.plan.shape(1, 1)
        assert len(started.several.variants) > 1
        assert started.several.compiled == (one,)  # at ready, before the background compiles end
        assert started.compiler.wait(120)
        assert started.several.compiled == (one,) and started.several.num_requested_pending == 0
    finally:
        started.compiler.stop()
        started.several.stop()
    everything = start(cfg, params, ENGINE, warmup="all")
    assert everything.several is not None
    assert everything.several.num_compiled == 0 and everything.several.num_requested_pending == 0
