"""Assembly: turn an EngineConfig into a ready Engine (and, for serve/, an AsyncEngine with the
ServedModel record of tl/entry/served.py).

Owns: the order of start-up (multi-host: the step channel, then jax.distributed -> the model's
start-up pipeline (tl/runtime/startup.py: plan, place, measure, compile, warm-up, and its log of
backend, devices, kernels and weight pages) -> runner -> engine -> freezing start-up's objects
out of the garbage collector's passes), what the runner is handed (the text side's bitmask
filler, the leader's step channel), and the multi-host roles: process 0 binds the step channel,
waits for its followers to connect and then to be ready, and hands the channel to its runner
(each end told when this process compiles); a follower (`run_follower`) connects,
builds the same runner and follows (tl/entry/multihost.py). Each of those waits is bounded by
group_start_timeout_s (tl/entry/group_start.py: one ERROR line naming who is missing, exit status 4).
Must not hold state. Tested through tests/entry/test_cli.py, the server tests and tests/entry/test_multihost.py.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from tl.core import debug_delays
from tl.core.config import EngineConfig, Group, multihost_group

if TYPE_CHECKING:
    from tl.core.async_engine import AsyncEngine
    from tl.core.engine import Engine
    from tl.entry.multihost import Leader
    from tl.entry.served import ServedModel
    from tl.runtime.runner import ModelRunner

log = logging.getLogger("tl.entry.build")


def build_engine(
    cfg: EngineConfig,
    warmup: bool = True,
    background: bool = False,
    on_group_failure: Callable[[str], None] | None = None,
) -> Engine:
    """Load the model named by cfg.model_dir and wrap it in an Engine.

    With warmup, the plan's start-up step variants are compiled before this returns and the
    rest then (background False: serving never compiles) or on a background thread while the
    engine serves (tl/runtime/compiler.py: a step meanwhile runs in a larger compiled variant); without
    it (the CLI's one-shot generate) variants compile on first use. In a multi-host job this
    is process 0: it waits for every follower, and `on_group_failure(reason)` runs when one is
    lost (then the process exits, status 3).
    """
    return _runner_and_engine(cfg, warmup, background, on_group_failure)[1]


def _runner_and_engine(
    cfg: EngineConfig, warmup: bool, background: bool, on_group_failure: Callable[[str], None] | None
) -> tuple[ModelRunner, Engine]:
    """build_engine's work; the runner too, for what serving reads of the model (its config)."""
    from tl.core.engine import Engine
    from tl.entry.group_start import start_deadline
    from tl.runtime import startup
    from tl.runtime.runner import ModelRunner
    from tl.text.grammar import fill_masks

    debug_delays.configure(os.environ.get("TL_DEBUG_DELAYS", ""))  # tests only: tl/core/debug_delays.py
    leader = _leader(cfg, multihost_group(cfg, os.environ), on_group_failure)
    debug_delays.debug_delay("load")
    started = startup.load(cfg, warmup=("background" if background else "all") if warmup else "none")
    runner = ModelRunner(started, peers=leader, fill_masks=fill_masks)
    if warmup:
        # Start-up leaves ~100k long-lived objects (JAX, the tokenizer, compiled steps); frozen,
        # the collector's full passes skip them: one mid-stream took 97 ms, four decode steps.
        gc.collect()
        gc.freeze()
    if leader is not None:
        log.info("waiting for the %d followers' start-up", leader.num_followers)
        with start_deadline(cfg.group_start_timeout_s, leader.not_ready):
            leader.wait_ready()
    from tl.runtime.kv_publisher import kv_publisher

    return runner, Engine(runner, cfg, kv_events=kv_publisher(cfg, runner.block_size))


def _leader(cfg: EngineConfig, group: Group | None, on_failure: Callable[[str], None] | None) -> Leader | None:
    """Process 0 of a multi-host job: the step channel bound (on the coordinator's host), then,
    within group_start_timeout_s, the job joined and every follower connected; None on one
    process (jax.distributed joined all the same when configured). Another process here is a
    mistake: the followers run `run_follower` (serve starts it for a known process_id > 0)."""
    from tl.core.config import ConfigError
    from tl.entry.group_start import start_deadline
    from tl.entry.multihost import Leader, step_address
    from tl.runtime.backend import init_distributed
    from tl.runtime.compiler import compiling_now

    if group is None or group.num_processes == 1:
        init_distributed(group, cfg.group_start_timeout_s)
        return None
    count, index = group.num_processes, group.process_id
    if count == 0 or index != 0:  # the leader names its followers before jax.distributed forms
        raise ConfigError(
            "the server of a multi-host job is process 0 and needs process_id and num_processes known at "
            f"start (config or JAX_PROCESS_ID, JAX_NUM_PROCESSES), got process_id "
            f"{index if index >= 0 else 'unknown'} and num_processes {count or 'unknown'}; "
            "processes other than 0 start as followers"
        )
    host, port = step_address(jax_coordinator(group), cfg.step_port)
    leader = Leader(count - 1, cfg.peer_timeout_s, on_failure, busy=compiling_now)
    try:
        bound = leader.listen(host, port)
    except OSError:  # the coordinator's name is not one of this host's addresses (a Service in front)
        bound = leader.listen("", port)
        host = "all interfaces"
    log.info("step channel listening on %s:%d for %d followers", host, bound, leader.num_followers)
    with start_deadline(cfg.group_start_timeout_s, leader.not_connected):
        init_distributed(group, cfg.group_start_timeout_s)
        leader.wait_connected()
    return leader


def jax_coordinator(group: Group) -> str:
    """The coordinator address the job was started with (config, JAX_COORDINATOR_ADDRESS)."""
    if not group.coordinator_address:
        raise ValueError("a multi-host job needs coordinator_address (or JAX_COORDINATOR_ADDRESS) to serve")
    return group.coordinator_address


def is_follower(cfg: EngineConfig) -> bool:
    """This process follows a multi-host job (a known process id other than 0): it runs
    `run_follower`, not the server."""
    from tl.entry.multihost import is_follower as follower

    return follower(multihost_group(cfg, os.environ))


def run_follower(cfg: EngineConfig, on_ready: Callable[[Callable[[], bool]], None]) -> int:
    """A follower's whole life: join the job, connect to the leader's step channel, build the
    same runner and compile its start-up variants, call `on_ready(is_ready)` (is_ready: the
    leader still reachable), then run the leader's steps until it stops the group (returns 0).
    A lost leader or a stuck step exits the process with status 3 (tl/entry/multihost.py); a leader
    not reached or a job not formed within group_start_timeout_s, with status 4
    (tl/entry/group_start.py). It connects before it joins jax.distributed: the leader then knows it."""
    from tl.entry.group_start import start_deadline
    from tl.entry.multihost import Follower, GroupFailed, follow, step_address
    from tl.runtime import startup
    from tl.runtime.backend import init_distributed
    from tl.runtime.compiler import compiling_now
    from tl.runtime.runner import ModelRunner

    group = multihost_group(cfg, os.environ)
    assert group is not None and group.process_id > 0, "a follower's process id is known (is_follower)"
    index = group.process_id
    chan = Follower(index, cfg.peer_timeout_s, busy=compiling_now)
    host, port = step_address(jax_coordinator(group), cfg.step_port)

    def missing() -> str:
        if chan.conn is None:
            return f"process {index}: the leader (process 0) did not answer on its step channel at {host}:{port}"
        return f"process {index}: jax.distributed did not form (the leader is connected: another process is missing)"

    log.info("process %d: connecting to the leader's step channel at %s:%d", index, host, port)
    with start_deadline(cfg.group_start_timeout_s, missing):
        chan.connect(host, port)
        log.info("process %d: connected to the leader's step channel at %s:%d", index, host, port)
        init_distributed(group, cfg.group_start_timeout_s)
    runner = ModelRunner(startup.load(cfg, warmup="background"))
    gc.collect()
    gc.freeze()
    chan.announce_ready()
    on_ready(lambda: chan.reachable)
    log.info("process %d ready: following the leader's steps", index)
    try:
        follow(chan, runner)
    except GroupFailed:
        return 3  # the exit is on its way (tl/entry/multihost.py), status 3
    finally:
        runner.close()
    chan.close()
    log.info("process %d: stopped by the leader", index)
    return 0


def build_async_engine(cfg: EngineConfig, warmup: bool = True) -> tuple[AsyncEngine, ServedModel]:
    """The serving form: an Engine behind the engine thread (with the grammar compiler of
    structured output), and the record of the model it serves (tokenizer, chat template, tool
    calling, reasoning, limits; the vocabulary size from the model's config as the runner loaded it)."""
    from tl.core.async_engine import AsyncEngine
    from tl.entry.served import ServedModel
    from tl.model.convert_gguf import model_dir_of
    from tl.text.chat_template import ChatTemplate
    from tl.text.grammar import GrammarCompiler
    from tl.text.reasoning import setup as reasoning_setup
    from tl.text.tokenizer import Tokenizer
    from tl.text.tools import setup

    cfg = dataclasses.replace(cfg, model_dir=model_dir_of(cfg.model_dir))  # a .gguf: its directory
    tokenizer = Tokenizer.load(cfg.model_dir)
    template = ChatTemplate.from_model_dir(cfg.model_dir)
    tools = setup(cfg.tool_parser, template)
    log.info("%s", tools.reason)
    reasoning = reasoning_setup(cfg.reasoning_parser, "\n".join(template.sources.values()), tokenizer)
    log.info("%s", reasoning.reason)
    built: list[AsyncEngine] = []
    # A multi-host group losing a process: every request fails with 503, then the exit (status 3).
    runner, engine = _runner_and_engine(
        cfg, warmup=warmup, background=True, on_group_failure=lambda why: built[0].fail(why) if built else None
    )
    vocab_size = runner.model_config.vocab_size
    grammars = GrammarCompiler.from_model_dir(
        cfg.model_dir, vocab_size, engine.eos_token_ids, cfg.grammar_cache_size, cfg.grammar_timeout_s
    )
    built.append(AsyncEngine(engine, grammars))
    model = ServedModel(
        cfg.served_model_id(),
        engine.max_model_len,
        vocab_size,
        cfg.max_logprobs,
        tokenizer,
        template,
        tools,
        reasoning.markers,
        None if cfg.thinking_token_budget < 0 else cfg.thinking_token_budget,
    )
    return built[0], model
