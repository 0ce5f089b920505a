"""Offline engine benchmark: N requests run to completion through Engine.step, no HTTP.

Workloads (seeded):
- `mixed`: prompt/output lengths drawn from a seeded distribution, all submitted at once.
- `shared-prefix`: one long common system prompt plus a short unique question: prefix hit ratio.
- `repetitive`: code-editing prompts whose answer repeats the prompt: speculative acceptance.
Reports output tokens/s, mean batch size (sequences and tokens per step), step time
percentiles, prefix hit ratio and speculative acceptance. Run: `python -m bench engine`.
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


def run(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench engine")
    ap.add_argument("--model", default="artifacts/models/smol-135m")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--workloads", default="mixed,shared-prefix,repetitive")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speculative", default="prompt_lookup", help="used for the repetitive workload")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    print("config:", json.dumps(vars(args)))

    from tl.ops.build import build_engine

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
