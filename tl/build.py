"""Assembly: turn an EngineConfig into a ready Engine (and, for serve/, an AsyncEngine).

Owns: the order of start-up (jax.distributed on multi-host -> model dir -> runner -> engine ->
warm-up -> freezing start-up's objects out of the garbage collector's passes), the start-up
log of backend, devices, attention kernel and weight pages, and nothing else.
Must not hold state. Tested through tests/test_cli.py and the server tests.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import TYPE_CHECKING

from kernels.cpu_build import cpu_model
from tl.config import EngineConfig

if TYPE_CHECKING:
    from tl.async_engine import AsyncEngine
    from tl.engine import Engine

log = logging.getLogger("tl.build")


def build_engine(cfg: EngineConfig, warmup: bool = True) -> Engine:
    """Load the model named by cfg.model_dir and wrap it in an Engine.

    With warmup, every step bucket is compiled before this returns, so serving never
    compiles (embeddings run in the same steps); without it (the CLI's one-shot generate)
    buckets compile on first use.
    """
    from tl.backend import init_distributed
    from tl.engine import Engine
    from tl.runner import ModelRunner

    init_distributed(cfg, os.environ)
    t0 = time.perf_counter()
    runner = ModelRunner.from_model_dir(cfg)
    log.info("loaded %s in %.1f s", cfg.model_dir, time.perf_counter() - t0)
    b = runner.backend_info
    log.info(
        "backend %s: %d x %s over %d process(es), tensor_parallel %d (KV heads %s), dtype %s, KV cache %s",
        b.platform,
        b.device_count,
        b.device_kind,
        b.process_count,
        b.tensor_parallel,
        b.kv_heads,
        b.dtype,
        b.kv_cache_dtype,
    )
    log.info(
        "attention: %s (%s); layer matmuls: %s (%s), precision %s (%s)",
        b.attention_kernel,
        runner.attention.reason,
        b.matmul_kernel,
        runner.matmul.reason,
        b.matmul_precision,
        runner.precision_reason,
    )
    if runner.verdicts.verdicts:
        log.info("native kernels (%s build, %s): verdicts %s", b.native_target, cpu_model(), runner.verdicts.source)
        for line in runner.kernel_lines:
            log.info("  %s", line)
    log.info("weight pages: %s (%s)", runner.weight_pages, runner.weight_pages_reason)
    if warmup:
        t0 = time.perf_counter()
        runner.warmup()
        log.info("compiled %d step variants in %.1f s", runner.num_compilations, time.perf_counter() - t0)
        # Start-up leaves ~100k long-lived objects (JAX, the tokenizer, compiled steps); frozen,
        # the collector's full passes skip them: one mid-stream took 97 ms, four decode steps.
        gc.collect()
        gc.freeze()
    return Engine(runner, cfg)


def build_async_engine(cfg: EngineConfig, warmup: bool = True) -> AsyncEngine:
    """The serving form: an Engine plus tokenizer and chat template behind the engine thread."""
    from tl.async_engine import AsyncEngine
    from tl.chat_template import ChatTemplate
    from tl.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(cfg.model_dir)
    template = ChatTemplate.from_model_dir(cfg.model_dir)
    return AsyncEngine(build_engine(cfg, warmup=warmup), tokenizer, template, cfg.served_model_id())
