"""Mixed-step benchmark: one compiled step holding many decodes and a fresh prompt chunk.

The step shape continuous batching produces under load (decodes first, then prefill work).
Times it with the cached-attention row split on (the default) and off, interleaved in one run,
and prints both medians and their ratio. The split is a form of the jnp reference's cached part,
so the runner uses `--attention-kernel reference` unless told otherwise (cpu_native reads each
token's blocks itself and ignores it). Run: `python -m bench mixed`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Sequence

from bench.report import print_table
from tl.core.config import EngineConfig
from tl.core.plan import SchedulerOutput, SeqWork
from tl.core.request import SamplingParams


def _plan(decodes: int, context: int, prompt: int, block_size: int) -> SchedulerOutput:
    greedy, work, nb = SamplingParams(temperature=0.0), [], 0
    per_seq = context // block_size + 2
    for s in range(decodes):
        work.append(SeqWork(s, (100 + s,), context, tuple(range(nb, nb + per_seq)), True, greedy, s, 10))
        nb += per_seq
    blocks = -(-prompt // block_size)
    work.append(
        SeqWork(decodes, tuple(range(200, 200 + prompt)), 0, tuple(range(nb, nb + blocks)), True, greedy, decodes, 0)
    )
    return SchedulerOutput(tuple(work))


def run(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench mixed")
    ap.add_argument("--model", default="artifacts/models/smol-135m")
    ap.add_argument("--decodes", type=int, default=60)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=452)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--attention-kernel", default="reference", help="the row split applies to the reference")
    args = ap.parse_args(argv)
    print("config:", json.dumps(vars(args)))

    from tl.runtime.runner import ModelRunner
    from tl.runtime.step_io import StepPacker

    bs, tokens = 16, args.decodes + args.prompt
    blocks = args.decodes * (args.context // bs + 2) + args.prompt // bs + 8
    cfg = EngineConfig(
        model_dir=args.model,
        num_kv_blocks=blocks,
        token_buckets=(tokens,),
        seq_buckets=(args.decodes + 1,),
        max_num_seqs=args.decodes + 1,
        max_num_batched_tokens=tokens,
        attention_kernel=args.attention_kernel,
    )
    # One runner per packing: `head_rows` is static, part of the compiled variant's layout, and
    # each runner compiles its variant on first use, under the packing then in force.
    runners = {"split": ModelRunner.from_model_dir(cfg), "no split": ModelRunner.from_model_dir(cfg)}
    plan = _plan(args.decodes, args.context, args.prompt, bs)
    split = StepPacker.tokens

    def no_split(self: StepPacker, *a: object, **k: object) -> object:
        inp, rows = split(self, *a, **k)  # type: ignore[arg-type]
        return dataclasses.replace(inp, meta=dataclasses.replace(inp.meta, head_rows=0)), rows

    def median_s(pack: Callable[..., object], runner: ModelRunner) -> float:
        StepPacker.tokens = pack  # type: ignore[method-assign]
        runner.execute(plan)  # compile (first round) / warm
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            runner.execute(plan)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    res: dict[str, list[float]] = {"split": [], "no split": []}
    for _ in range(args.rounds):
        res["split"].append(median_s(split, runners["split"]))
        res["no split"].append(median_s(no_split, runners["no split"]))
    StepPacker.tokens = split  # type: ignore[method-assign]
    rows: list[dict[str, object]] = [
        {
            "variant": k,
            "step ms p50": round(statistics.median(v) * 1e3, 1),
            "tokens/s": round(tokens / statistics.median(v), 1),
        }
        for k, v in res.items()
    ]
    print_table(rows)
    print(f"ratio no split / split: {statistics.median(res['no split']) / statistics.median(res['split']):.2f}")
    return 0
