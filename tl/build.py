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

from tl.config import EngineConfig

if TYPE_CHECKING:
    from tl.async_engine import AsyncEngine
    from tl.engine import Engine

log = logging.getLogger("tl.build")


def build_engine(cfg: EngineConfig, warmup: bool = True, background: bool = False) -> Engine:
    """Load the model named by cfg.model_dir and wrap it in an Engine.

    With warmup, the plan's start-up step variants are compiled before this returns and the
    rest then (background False: serving never compiles) or on a background thread while the
    engine serves (tl/compiler.py: a step meanwhile runs in a larger compiled variant); without
    it (the CLI's one-shot generate) variants compile on first use.
    """
    from tl.backend import init_distributed
    from tl.engine import Engine
    from tl.runner import ModelRunner

    init_distributed(cfg, os.environ)
    t0 = time.perf_counter()
    runner = ModelRunner.from_model_dir(cfg)
    kv_mib = sum(x.nbytes for x in runner.kv_cache) >> 20
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in runner.startup_seconds.items())
    log.info("loaded %s in %.1f s (%s; KV cache %d MiB)", cfg.model_dir, time.perf_counter() - t0, parts, kv_mib)
    for line in runner.plan.lines():
        log.info("%s", line)
    if warmup:
        t0 = time.perf_counter()
        runner.warmup(background=background)
        if not background:
            log.info("compiled %d step variants in %.1f s", runner.compiler.num_compiled, time.perf_counter() - t0)
        # Start-up leaves ~100k long-lived objects (JAX, the tokenizer, compiled steps); frozen,
        # the collector's full passes skip them: one mid-stream took 97 ms, four decode steps.
        gc.collect()
        gc.freeze()
    return Engine(runner, cfg)


def build_async_engine(cfg: EngineConfig, warmup: bool = True) -> AsyncEngine:
    """The serving form: an Engine plus tokenizer and chat template behind the engine thread."""
    from tl.async_engine import AsyncEngine
    from tl.chat_template import ChatTemplate
    from tl.grammar import GrammarCompiler
    from tl.model.config import load_model_config
    from tl.tokenizer import Tokenizer
    from tl.tools import setup

    tokenizer = Tokenizer.load(cfg.model_dir)
    template = ChatTemplate.from_model_dir(cfg.model_dir)
    tools = setup(cfg.tool_parser, template)
    log.info("%s", tools.reason)
    engine = build_engine(cfg, warmup=warmup, background=True)
    grammars = GrammarCompiler.from_model_dir(
        cfg.model_dir,
        load_model_config(cfg.model_dir).vocab_size,
        engine.eos_token_ids,
        cfg.grammar_cache_size,
        cfg.grammar_timeout_s,
    )
    return AsyncEngine(engine, tokenizer, template, cfg.served_model_id(), grammars, tools)
