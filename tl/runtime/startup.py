"""Start-up: one pipeline from a model's config and tensors to everything its runner is built from.

Owns: `start`, the stages in order (size: the KV cache's blocks, tl/runtime/kv_size.py; plan:
the mesh and the execution plan; place: the KV cache
and the weights as the plan says; measure: the kernel verdicts over them, which complete the
plan and resolve its dispatch; compile: the step program and its table of variants; ready: the
variants compiled ahead of time as asked), the start-up log (load times, the plan's lines, the
warm-up's time), and `Startup`, the frozen record they make. `load` reads a model directory
first. Must not: decide (tl/runtime/execution.py), place (tl/runtime/placement.py), measure
(tl/runtime/verdicts.py), run steps (tl/runtime/runner.py). Tested through tests/runtime/test_runner.py,
tests/runtime/test_execution.py, tests/runtime/test_verdicts.py and tests/runtime/test_compiler.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import jax
import numpy as np
from jax.sharding import Mesh

from tl.core.config import EngineConfig
from tl.model.config import ModelConfig, load_model_config
from tl.model.convert_gguf import model_dir_of
from tl.model.files import eos_token_ids, has_gguf, read_tensors
from tl.runtime import backend, execution, kv_size, placement, verdicts
from tl.runtime.compiler import StepCompiler, enable_compile_cache
from tl.runtime.execution import ExecutionPlan
from tl.runtime.placement import PlacedWeights
from tl.runtime.step import StepProgram
from tl.runtime.step_io import StepPacker

log = logging.getLogger("tl.runtime.startup")

Warmup = Literal["none", "all", "background"]
"""What the ready stage compiles: nothing (each variant on first use: the CLI's one-shot generate,
benchmarks, tests), every variant before it returns, or the plan's start-up variants before and
the rest on a background thread (tl/runtime/compiler.py)."""


@dataclass(frozen=True, slots=True)
class Startup:
    """What start-up made, from which the runner is built (tl/runtime/runner.py stores it)."""

    model_config: ModelConfig
    engine_config: EngineConfig
    eos_token_ids: tuple[int, ...]
    mesh: Mesh
    layout: backend.TPLayout
    plan: ExecutionPlan  # measured: its `step_kernels` are what each step class runs
    weights: PlacedWeights
    kv: tuple[jax.Array, jax.Array]  # the zeroed cache; the runner's first step donates it
    packer: StepPacker
    program: StepProgram
    compiler: StepCompiler  # the compiled variants
    several: StepCompiler | None  # several decode steps' compiled variants (None: decode_steps 1)
    seconds: Mapping[str, float]  # plan, kv_cache, weights, verdicts


def start(
    cfg: ModelConfig,
    tensors: Mapping[str, np.ndarray],
    engine_cfg: EngineConfig,
    eos: Sequence[int] = (),
    mesh: Mesh | None = None,
    warmup: Warmup = "none",
) -> Startup:
    """Size the KV cache, plan, place, measure, compile, ready. tensors: Hugging Face names ->
    host arrays."""
    lap = _Laps()
    platform = backend.resolve_platform(engine_cfg.backend)
    engine_cfg = kv_size.sized(cfg, engine_cfg, platform)
    if jax.process_count() == 1:  # a group's hosts each hold their shards: no one host's total
        kv_size.check_fits(cfg, engine_cfg, platform, tensors)
    plan, mesh, layout = _plan(cfg, engine_cfg, platform, mesh)
    lap("plan")
    kv = placement.alloc_kv(
        cfg, mesh, layout.kv_spec, engine_cfg.num_kv_blocks + 1, engine_cfg.block_size, plan.kv_dtype
    )
    lap("kv_cache")
    weights = _place_weights(tensors, cfg, engine_cfg, mesh, layout, plan)
    lap("weights")
    plan = _measure(plan, cfg, weights)
    lap("verdicts")
    _log_loaded(engine_cfg, plan, kv, lap)
    eos_ids = tuple(eos) or cfg.eos_token_ids
    packer, program, compiler, several = _compile(cfg, engine_cfg, mesh, layout, plan, weights, kv, eos_ids)
    _ready(compiler, several, plan, warmup)
    return Startup(
        cfg, engine_cfg, eos_ids, mesh, layout, plan, weights, kv, packer, program, compiler, several, lap.seconds
    )


def load(engine_cfg: EngineConfig, mesh: Mesh | None = None, warmup: Warmup = "none") -> Startup:
    """`start` on the model in engine_cfg.model_dir (its config, tensors and EOS ids; a `.gguf`
    file through the directory that serves it). weight_dtype "auto" serves a directory's GGUF
    as it is, where it keeps one."""
    d = model_dir_of(engine_cfg.model_dir)
    ec = replace(engine_cfg, model_dir=d)
    tensors = read_tensors(d, packed=ec.weight_dtype == "auto" and has_gguf(d))
    return start(load_model_config(d), tensors, ec, eos_token_ids(d), mesh, warmup)


class _Laps:
    """Each stage's seconds, from the end of the one before."""

    def __init__(self) -> None:
        self.t0 = self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def __call__(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage], self.last = now - self.last, now


def _plan(
    cfg: ModelConfig, ec: EngineConfig, platform: str, mesh: Mesh | None
) -> tuple[ExecutionPlan, Mesh, backend.TPLayout]:
    """The tensor-parallel layout and mesh on `platform`, and the plan before measurement."""
    enable_compile_cache(ec.compile_cache_dir)
    layout = backend.tp_layout(cfg, mesh.shape["model"] if mesh else ec.tensor_parallel)
    mesh = mesh or backend.make_mesh(platform, ec.tensor_parallel)
    return execution.plan_execution(ec, cfg, platform, mesh, layout), mesh, layout


def _place_weights(
    tensors: Mapping[str, np.ndarray],
    cfg: ModelConfig,
    ec: EngineConfig,
    mesh: Mesh,
    layout: backend.TPLayout,
    plan: ExecutionPlan,
) -> PlacedWeights:
    return placement.place_weights(
        tensors,
        cfg,
        mesh,
        layout,
        plan.compute_dtype,
        ec.weight_dtype,
        pack_bf16x3=plan.precision.value == "high",
        huge_pages=plan.weight_pages.value == "huge",
        panels=plan.weight_layout.value == "panels",
    )


def _measure(plan: ExecutionPlan, cfg: ModelConfig, weights: PlacedWeights) -> ExecutionPlan:
    """The plan completed: the verdicts of its measured classes (over the placed weights), the
    weight placement's outcome, and so the step's dispatch."""
    measured = verdicts.measure_runner(plan, plan.kernels, cfg, weights.params)
    return plan.measured(measured, weights.pages, weights.reason or plan.weight_pages.reason)


def _log_loaded(ec: EngineConfig, plan: ExecutionPlan, kv: tuple[jax.Array, jax.Array], lap: _Laps) -> None:
    kv_mib = sum(x.nbytes for x in kv) / 2**20
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in lap.seconds.items())
    log.info("loaded %s in %.1f s (%s)", ec.model_dir, time.perf_counter() - lap.t0, parts)
    log.info(
        "KV cache: %s, %.1f MiB, %d tokens (%d blocks of %d)",
        plan.kv_storage.value,
        kv_mib,
        ec.num_kv_blocks * ec.block_size,
        ec.num_kv_blocks,
        ec.block_size,
    )
    for line in plan.lines():
        log.info("%s", line)


def _compile(
    cfg: ModelConfig,
    ec: EngineConfig,
    mesh: Mesh,
    layout: backend.TPLayout,
    plan: ExecutionPlan,
    weights: PlacedWeights,
    kv: tuple[jax.Array, jax.Array],
    eos_ids: tuple[int, ...],
) -> tuple[StepPacker, StepProgram, StepCompiler, StepCompiler | None]:
    """The packer of the step's inputs, the step program traced from the plan's dispatch, the
    (empty) table of its compiled variants, and with decode_steps > 1 that of its several decode
    steps (one variant per decode-only step shape: each sequence count's buckets)."""
    assert plan.step_kernels is not None, "the plan is measured"
    packer = StepPacker(
        block_size=ec.block_size,
        num_kv_blocks=ec.num_kv_blocks,
        max_model_len=ec.max_model_len or cfg.max_position_embeddings,
        max_blocks=plan.max_blocks,
        chunk_blocks=plan.chunk_blocks,
        spec_tokens=ec.spec_tokens,
        vocab_size=cfg.vocab_size,
    )
    program = StepProgram(
        cfg,
        plan.step_kernels,
        packer,
        mesh,
        layout.kv_spec,
        ec.max_logprobs,
        weights.params,
        kv,
        decode_steps=ec.decode_steps,
        eos_ids=eos_ids,
    )
    several = None
    if ec.decode_steps > 1:
        shapes = {plan.shape(n, n) for n in range(1, ec.max_num_seqs + 1)}
        several = StepCompiler(program.compile_steps, sorted(shapes & set(plan.variants)))
    return packer, program, StepCompiler(program.compile, plan.variants), several


def _ready(compiler: StepCompiler, several: StepCompiler | None, plan: ExecutionPlan, warmup: Warmup) -> None:
    """The step variants compiled ahead of time as `warmup` asks. In the background (a server)
    one sequence's several-decode-steps program is compiled before ready too, after the start-up
    variants and before the background compiles begin: asked for after them, a lone request's
    first decodes ran a step a call until every step variant had compiled (one stream at 0.46x
    llama.cpp's rate, not 1.16x, on a 2-core Zen 3 when that compile fell in the run; at Llama
    3.1 8B shapes the step variants take 133 s, that program 6.8 s). Other sequence counts' are
    compiled when a step first asks for their shape (the runner's `decode_steps`); a multi-host
    group runs a step a call."""
    if warmup == "none":
        return
    t0 = time.perf_counter()
    if warmup == "all":
        compiler.warm_up(plan.startup_variants, background=False)
        log.info("compiled %d step variants in %.1f s", compiler.num_compiled, time.perf_counter() - t0)
        return
    compiler.compile_startup(plan.startup_variants)
    one = plan.shape(1, 1)
    if several is not None and one in several.variants and jax.process_count() == 1:
        t1 = time.perf_counter()
        several.ensure(one)
        log.info("compiled several decode steps for %dx%d before ready in %.1f s", *one, time.perf_counter() - t1)
    compiler.start_background()
