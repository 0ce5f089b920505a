"""Offline runner benchmark: the compiled step alone, no scheduler, no HTTP.

Measures, on one model: compile time per (token bucket, seq bucket) variant used, decode
tokens/s at each sequence bucket (every sequence decoding one token per step at a fixed
context length), and prefill tokens/s of one 512-token prompt. Prints its full config,
then a Markdown table; `--json` also writes JSON lines. Run: `python -m bench runner`.
`--compare-kernel reference` builds a second runner with that attention kernel and times the
two alternately, step by step, in one process: the ratios hold on a noisy machine;
`--compare-kv-cache-dtype bfloat16` does the same for a second KV cache format.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence

from bench.report import print_table
from tl.core.config import EngineConfig
from tl.core.plan import SchedulerOutput, SeqWork
from tl.core.request import SamplingParams


def _timed(fn: object, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        out.append(time.perf_counter() - t0)
    return out


def _host_ms(r: object, plan: SchedulerOutput) -> tuple[float, float]:
    """One execute of plan: (host ms: packing, launching and unpacking; ms waiting for the results)."""
    t = r.execute(plan).times  # type: ignore[attr-defined]
    if t is None:
        return 0.0, 0.0
    host = (t.packed - t.started) + (t.launched - t.packed) + (t.unpacked - t.fetched)
    return host * 1e3, (t.fetched - t.launched) * 1e3


def _decode_plan(batch: int, ctx: int, block_size: int, vocab: int) -> SchedulerOutput:
    blocks_per_seq = (ctx + block_size) // block_size + 1
    params = SamplingParams(temperature=0.0)
    work = []
    for s in range(batch):
        table = tuple(range(s * blocks_per_seq, (s + 1) * blocks_per_seq))
        work.append(
            SeqWork(
                seq_id=s,
                token_ids=((s * 7 + 11) % vocab,),
                start_pos=ctx,
                block_table=table,
                sample=True,
                params=params,
                seed=s,
                num_generated=ctx,
            )
        )
    return SchedulerOutput(tuple(work))


def _prefill_plan(n: int, vocab: int, block_size: int) -> SchedulerOutput:
    table = tuple(range((n + block_size - 1) // block_size))
    ids = tuple((i * 31 + 7) % vocab for i in range(n))
    return SchedulerOutput(
        (
            SeqWork(
                seq_id=0,
                token_ids=ids,
                start_pos=0,
                block_table=table,
                sample=True,
                params=SamplingParams(temperature=0.0),
                seed=0,
                num_generated=0,
            ),
        )
    )


def run(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench runner")
    ap.add_argument("--model", default="artifacts/models/smol-135m")
    ap.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 on GPU/TPU")
    ap.add_argument("--backend", default="auto")
    ap.add_argument(
        "--weight-dtype",
        default="float32",
        choices=["auto", "float32", "int8", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "f16", "bf16"],
        help="[engine] weight_dtype (auto: a GGUF --model, or a directory's model.gguf, as it is)",
    )
    ap.add_argument("--attention-kernel", default="auto")
    ap.add_argument("--tensor-parallel", type=int, default=1)
    ap.add_argument("--context", type=int, default=256, help="context length of each decoding sequence")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json", default="", help="also append JSON lines to this file")
    ap.add_argument("--native-target", default="auto", help="[engine] native_target: the native kernels' build")
    ap.add_argument("--compare-kernel", default="", help="also time a runner with this attention_kernel, alternately")
    ap.add_argument("--kv-cache-dtype", default="auto", help="[engine] kv_cache_dtype")
    ap.add_argument(
        "--compare-kv-cache-dtype", default="", help="also time a runner with this kv_cache_dtype, alternately"
    )
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]

    from tl.runtime.runner import ModelRunner

    bs = 16
    blocks = max(b for b in batches) * ((args.context + bs) // bs + 1) + 64
    cfg = EngineConfig(
        model_dir=args.model,
        dtype=args.dtype,
        weight_dtype=args.weight_dtype,
        backend=args.backend,
        attention_kernel=args.attention_kernel,
        tensor_parallel=args.tensor_parallel,
        num_kv_blocks=blocks,
        block_size=bs,
        max_num_seqs=max(batches),
        seq_buckets=tuple(sorted(set(batches))),
        token_buckets=tuple(sorted(set(batches) | {args.prefill})),
        max_num_batched_tokens=max(args.prefill, max(batches)),
        prefill_chunk=args.prefill,
        native_target=args.native_target,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    if args.compare_kernel and args.compare_kv_cache_dtype:
        raise SystemExit("--compare-kernel and --compare-kv-cache-dtype: one comparison a run")
    print(
        "config:",
        json.dumps(
            {
                "model": args.model,
                "dtype": args.dtype,
                "weight_dtype": args.weight_dtype,
                "backend": args.backend,
                "attention_kernel": args.attention_kernel,
                "tensor_parallel": args.tensor_parallel,
                "context": args.context,
                "prefill": args.prefill,
                "batches": batches,
                "repeat": args.repeat,
                "compare_kernel": args.compare_kernel,
                "kv_cache_dtype": args.kv_cache_dtype,
                "compare_kv_cache_dtype": args.compare_kv_cache_dtype,
                "num_kv_blocks": blocks,
                "block_size": bs,
            }
        ),
    )
    runner = ModelRunner.from_model_dir(cfg)
    runners = [("", runner)]
    if args.compare_kernel:
        other = ModelRunner.from_model_dir(cfg.replace(attention_kernel=args.compare_kernel))
        if other.kernels.attention.name == runner.kernels.attention.name:
            raise SystemExit(
                f"--compare-kernel: both runners use {runner.kernels.attention.name} "
                f"({other.kernels.attention.reason}); compare two different kernels"
            )
        runners = [(runner.kernels.attention.name, runner), (other.kernels.attention.name, other)]
    if args.compare_kv_cache_dtype:
        other = ModelRunner.from_model_dir(cfg.replace(kv_cache_dtype=args.compare_kv_cache_dtype))
        mine, theirs = runner.backend_info.kv_cache_dtype, other.backend_info.kv_cache_dtype
        if mine == theirs:
            raise SystemExit(f"--compare-kv-cache-dtype: both caches hold {mine}; compare two formats")
        runners = [(f"kv {mine}", runner), (f"kv {theirs}", other)]
    b_info = runner.backend_info
    print(
        "backend:",
        json.dumps(
            {
                "platform": b_info.platform,
                "device_kind": b_info.device_kind,
                "devices": b_info.device_count,
                "dtype": b_info.dtype,
                "attention": b_info.attention_kernel,
                "why": runner.kernels.attention.reason,
                "matmul": runner.kernels.matmul.name,
            }
        ),
    )
    vocab = runner.model_config.vocab_size
    rows: list[dict[str, object]] = []
    plans = [
        (f"prefill {args.prefill}", args.prefill, _prefill_plan(args.prefill, vocab, bs), max(3, args.repeat // 3))
    ]
    plans += [
        (f"decode batch {b} @ctx {args.context}", b, _decode_plan(b, args.context, bs, vocab), args.repeat)
        for b in batches
    ]
    ratios: list[dict[str, object]] = []
    for test, tokens, plan, repeat in plans:
        first = {label: _timed(lambda r=r, plan=plan: r.execute(plan), 1)[0] for label, r in runners}
        times: dict[str, list[float]] = {label: [] for label, _ in runners}
        split: dict[str, list[tuple[float, float]]] = {label: [] for label, _ in runners}
        for i in range(repeat):  # alternate the runners step by step, each going first in turn
            for label, r in runners[:: 1 if i % 2 == 0 else -1]:
                times[label] += _timed(lambda r=r, plan=plan: r.execute(plan), 1)
                split[label].append(_host_ms(r, plan))
        for label, _ in runners:
            med = statistics.median(times[label])
            rows.append(
                {
                    "test": test + (f" [{label}]" if label else ""),
                    "tokens/s": round(tokens / med, 1),
                    "step ms p50": round(med * 1e3, 1),
                    "host ms p50": round(statistics.median(h for h, _ in split[label]), 2),
                    "wait ms p50": round(statistics.median(w for _, w in split[label]), 2),
                    "compile s": round(first[label] - med, 2),
                }
            )
        if len(runners) == 2:
            (a, _), (b, _) = runners
            ratios.append(
                {"test": test, f"{a} / {b} speed": round(statistics.median(times[b]) / statistics.median(times[a]), 3)}
            )
    print_table(rows)
    if ratios:
        print_table(ratios)
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps({"bench": "runner", **r}) + "\n")
    from bench.roofline import load_model_cost, print_offline_roofline
    from tl.model.convert_gguf import model_dir_of

    # Each row's steps/s is exact here: one compiled step per timed call.
    items = [(str(r["test"]), float(str(r["tokens/s"])), 1e3 / float(str(r["step ms p50"]))) for r in rows]
    mdir = model_dir_of(args.model)  # a .gguf: the directory that serves it
    import jax

    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(runner.params))  # what a one-row step reads
    print_offline_roofline(
        mdir,
        items,
        bytes_per_param=weight_bytes / load_model_cost(mdir, 1).num_params,
        platform=b_info.platform,
        dtype=b_info.dtype,
    )
    return 0
