"""Offline engine benchmark: N requests run to completion through Engine.step, no HTTP.

Workloads (seeded):
- `mixed`: prompt/output lengths drawn from a seeded distribution, all submitted at once.
- `shared-prefix`: one long common system prompt plus a short unique question: prefix hit ratio.
- `repetitive`: code-editing prompts whose answer repeats the prompt: speculative acceptance.
Reports output tokens/s, mean batch size (sequences and tokens per step), step time
percentiles, prefix hit ratio and speculative acceptance. Run: `python -m bench engine`.
`--host-split 1,16,64` instead decodes that many streams at once and reports where each
step's wall time goes (schedule, pack, launch, waiting for results, unpack, update, between
steps) and the host gap between one step's results and the next launch.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence

from bench.report import print_table
from tl.core.config import EngineConfig
from tl.core.request import GenRequest, SamplingParams


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def _workload(name: str, n: int, vocab: int, rng: random.Random) -> list[GenRequest]:
    def toks(k: int) -> tuple[int, ...]:
        return tuple(rng.randrange(100, vocab) for _ in range(k))

    reqs = []
    if name == "mixed":
        for _ in range(n):
            p = SamplingParams(temperature=0.0, max_tokens=rng.randint(16, 128), ignore_eos=True)
            reqs.append(GenRequest(toks(rng.randint(16, 384)), p))
    elif name == "shared-prefix":
        system = toks(384)
        for _ in range(n):
            reqs.append(
                GenRequest(
                    system + toks(rng.randint(8, 32)), SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
                )
            )
    elif name == "repetitive":
        for _ in range(n):
            body = toks(rng.randint(24, 48))
            # "Rewrite this code:" <code> "Answer:" <code...>: the continuation repeats the prompt.
            reqs.append(
                GenRequest(
                    body + body + body[: len(body) // 2],
                    SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
                )
            )
    else:
        raise SystemExit(f"unknown workload {name!r}")
    return reqs


def run_workload(engine: object, reqs: list[GenRequest]) -> dict[str, object]:
    from tl.core.engine import Engine

    assert isinstance(engine, Engine)
    before = engine.stats()
    for r in reqs:
        engine.add_request(r)
    step_s, seqs, toks, n_out = [], [], [], 0
    t0 = time.perf_counter()
    while engine.has_work():
        ts = time.perf_counter()
        outs = engine.step()
        step_s.append(time.perf_counter() - ts)
        n_out += sum(1 for o in outs if o.token_id >= 0)
        st = engine.stats()
        seqs.append(st.running)
        toks.append(st.batch_tokens)
    wall = time.perf_counter() - t0
    st = engine.stats()
    q = st.prefix_cache_queries - before.prefix_cache_queries
    h = st.prefix_cache_hits - before.prefix_cache_hits
    prop = st.spec_drafts_proposed - before.spec_drafts_proposed
    acc = st.spec_drafts_accepted - before.spec_drafts_accepted
    return {
        "requests": len(reqs),
        "output tok/s": round(n_out / wall, 1),
        "steps": len(step_s),
        "mean seqs/step": round(statistics.fmean(seqs), 1),
        "mean tokens/step": round(statistics.fmean(toks), 1),
        "step ms p50": round(_pct(step_s, 0.5) * 1e3, 1),
        "step ms p90": round(_pct(step_s, 0.9) * 1e3, 1),
        "step ms p99": round(_pct(step_s, 0.99) * 1e3, 1),
        "prefix hit ratio": round(h / q, 3) if q else 0.0,
        "spec acceptance": round(acc / prop, 3) if prop else "",
        "preemptions": st.preemptions - before.preemptions,
    }


def host_split(engine: object, streams: int, tokens: int, vocab: int, seed: int) -> dict[str, object]:
    """`streams` requests of 16 prompt tokens decoding `tokens` each (ignore_eos), all at once:
    output tokens/s and, per busy step, where the wall time went (tl.core.stats.HOST_PARTS from
    EngineStats' sums), the host gap's mean and the host's share of the step."""
    from tl.core.engine import Engine

    assert isinstance(engine, Engine)
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for _ in range(streams):
        engine.add_request(GenRequest(tuple(rng.randrange(100, vocab) for _ in range(16)), params))
    before = engine.stats()
    n_out, t0 = 0, time.perf_counter()
    while engine.has_work():
        n_out += sum(1 for o in engine.step() if o.token_id >= 0)
    wall = time.perf_counter() - t0
    after = engine.stats()
    steps = after.timed_steps - before.timed_steps
    parts = {k: (v - dict(before.step_part_seconds).get(k, 0.0)) / max(1, steps) for k, v in after.step_part_seconds}
    total = sum(parts.values())
    gaps = after.host_gap_seconds.count - before.host_gap_seconds.count
    gap = (after.host_gap_seconds.total - before.host_gap_seconds.total) / max(1, gaps)
    return {
        "streams": streams,
        "output tok/s": round(n_out / wall, 1),
        "steps": steps,
        **{f"{k} ms": round(v * 1e3, 3) for k, v in parts.items()},
        "host gap ms": round(gap * 1e3, 3),
        "host share": round(1 - parts["device"] / total, 3) if total else 0.0,
    }


def run(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench engine")
    ap.add_argument("--model", default="artifacts/models/smol-135m")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--workloads", default="mixed,shared-prefix,repetitive")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speculative", default="prompt_lookup", help="used for the repetitive workload")
    ap.add_argument("--json", default="")
    ap.add_argument(
        "--host-split",
        default="",
        help="streams counts, e.g. 1,16,64: instead of the workloads, where each decode step's time goes",
    )
    ap.add_argument("--decode-tokens", type=int, default=128, help="tokens each --host-split stream decodes")
    ap.add_argument("--decode-steps", default="1", help="--host-split: [engine] decode_steps, e.g. 1,4 (alternated)")
    ap.add_argument(
        "--overlap",
        default="auto",
        help="--host-split: [engine] overlap, e.g. off,on (with each decode_steps; more than two configurations "
        "in one process can pass vm.max_map_count with every engine's compiled programs)",
    )
    ap.add_argument("--rounds", type=int, default=1, help="--host-split: runs of each configuration per stream count")
    ap.add_argument("--weight-dtype", default="auto", help="[engine] weight_dtype (auto: a GGUF as it is)")
    args = ap.parse_args(argv)
    print("config:", json.dumps(vars(args)))

    from tl.entry.build import build_engine

    if args.host_split:
        counts = [int(n) for n in args.host_split.split(",")]
        cfg = EngineConfig(model_dir=args.model, speculative="none", weight_dtype=args.weight_dtype)  # type: ignore[arg-type]
        cfg = cfg.replace(max_num_seqs=max(cfg.max_num_seqs, *counts))
        engines = []
        for k in (int(x) for x in args.decode_steps.split(",")):
            for overlap in args.overlap.split(","):
                engine = build_engine(cfg.replace(decode_steps=k, overlap=overlap), warmup=True)  # type: ignore[arg-type]
                vocab = engine.runner.model_config.vocab_size
                engine.runner.compile_several()  # type: ignore[attr-defined]
                engine.runner.feeds.background = False  # type: ignore[attr-defined]
                for n in counts:  # every program these steps take, run once (and each size's step timed)
                    host_split(engine, n, 16, vocab, args.seed)
                engines.append((f"steps {k} overlap {overlap}", engine))
        split = []
        for n in counts:  # the configurations alternated, each going first in turn
            for r in range(args.rounds):
                for name, engine in engines[:: 1 if r % 2 == 0 else -1]:
                    split.append({"config": name, **host_split(engine, n, args.decode_tokens, vocab, args.seed)})
        print_table(split)
        if len(engines) > 1:
            base = engines[0][0]
            ratios = []
            for n in counts:
                tps = {
                    name: statistics.median(
                        float(str(r["output tok/s"])) for r in split if r["streams"] == n and r["config"] == name
                    )
                    for name, _ in engines
                }
                ratios.append(
                    {
                        "streams": n,
                        **{f"tok/s {name} / {base}": round(tps[name] / tps[base], 3) for name, _ in engines[1:]},
                    }
                )
            print_table(ratios)
        if args.json:
            with open(args.json, "a") as f:
                for r in split:
                    f.write(json.dumps({"bench": "engine-host", **r}) + "\n")
        return 0

    rows = []
    for name in args.workloads.split(","):
        spec = args.speculative if name == "repetitive" else "none"
        cfg = EngineConfig(model_dir=args.model, speculative=spec)  # type: ignore[arg-type]
        engine = build_engine(cfg, warmup=True)
        reqs = _workload(name, args.requests, engine.runner.model_config.vocab_size, random.Random(args.seed))
        row = {"workload": name, "speculative": spec, **run_workload(engine, reqs)}
        if name == "repetitive" and spec != "none":
            base = build_engine(cfg.replace(speculative="none"), warmup=True)
            plain = run_workload(
                base, _workload(name, args.requests, engine.runner.model_config.vocab_size, random.Random(args.seed))
            )
            row["tok/s without spec"] = plain["output tok/s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print_table(rows)
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps({"bench": "engine", **r}) + "\n")
    from bench.roofline import print_offline_roofline

    # Work = tokens computed per step (prefill + decode) × steps/s, both from the median step.
    steps_s = [1e3 / float(str(r["step ms p50"])) for r in rows]
    items = [(str(r["workload"]), float(str(r["mean tokens/step"])) * s, s) for r, s in zip(rows, steps_s, strict=True)]
    print_offline_roofline(args.model, items)
    return 0
