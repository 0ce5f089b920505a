"""`python -m bench http`: the HTTP load benchmark against any OpenAI-compatible server.

Runs the tests of bench/load_tests.py (prefill, decode, sweep, shared, poisson) against
`--url`, and with `--compare URL` against a second server interleaved A, B, A, B per case (or,
with `--peer LLAMA_SERVER --gguf FILE`, llama.cpp's server started by bench/peer.py on the same
file at its best setting for each case), each server warmed up before each case,
then reports: JSON lines (config, roofline, every request, every summary, ratios), a
Markdown table (printed and in report.md), PNG plots, and the roofline line measured in
this run (memory read, fp32 GEMM, and the int8 ceiling: bench/int8_peak.py). Every run is
bounded (requests and seconds per run) and prints its config and seed first. Owns
orchestration and presentation; the client is bench/load.py.
Tested by tests/bench/test_bench_harness.py against a fake streaming server.

Example: `python -m bench http --url http://127.0.0.1:8000 --tests prefill,decode --out bench/out/x`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import aiohttp

from bench import int8_peak
from bench.load import Endpoint, RequestResult, first_model, summarize
from bench.load_prompts import PromptFactory, load_tokenizer
from bench.load_tests import Case, Limits, Run, Sizes, build_cases, run_interleaved
from bench.peer import Peer, PeerSpec, slots_for
from bench.report import markdown_table
from bench.roofline import Machine, ModelCost, fractions, load_model_cost, measure_machine, roofline_line

ALL_TESTS = "prefill,decode,sweep,shared,poisson"
RATIO_METRICS = (
    "output_tok_s",
    "work_tok_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "tpot_mean_ms",
    "latency_p50_ms",
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench http", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="server A base URL (without /v1)")
    ap.add_argument("--compare", default="", help="server B base URL: same tests, interleaved, with B/A ratios")
    ap.add_argument("--tests", default=ALL_TESTS)
    ap.add_argument("--api", default="completions", choices=["completions", "chat"])
    ap.add_argument("--model", default="", help="API model name (default: first of GET /v1/models)")
    ap.add_argument("--compare-model", default="", help="model name on server B (default: its first)")
    ap.add_argument(
        "--peer",
        default="",
        help="llama.cpp's llama-server executable: bench starts it as server B on --gguf, at its best setting "
        "for each test (-np 1 for prefill and one stream, -np N -c N*ctx for N streams); instead of --compare",
    )
    ap.add_argument("--gguf", default="", help="the GGUF file both servers serve: the peer's model, and the roofline's")
    ap.add_argument("--peer-threads", type=int, default=0, help="the peer's -t (0: every core)")
    ap.add_argument("--peer-ctx", type=int, default=4096, help="the peer's context a slot (-c = slots x this)")
    ap.add_argument("--warmup", type=int, default=1, help="requests to each server before each case, not counted")
    ap.add_argument(
        "--model-dir",
        default="artifacts/models/smol-135m",
        help="tokenizer.json for prompt sizing, config.json for the roofline",
    )
    ap.add_argument("--bytes-per-param", type=float, default=4, help="weight bytes per parameter (fp32 = 4, Q4_1 0.75)")
    ap.add_argument("--rate", type=float, default=2.0, help="Poisson arrival rate, requests/s")
    ap.add_argument("--levels", default="1,4,16,64", help="concurrency sweep levels")
    ap.add_argument("--repeats", type=int, default=1, help="repeats per case and server (interleaved)")
    ap.add_argument("--max-requests", type=int, default=256, help="cap on requests per run")
    ap.add_argument("--max-seconds", type=float, default=120.0, help="deadline per run; in-flight requests are cut")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--run-id",
        default=None,
        help="id in every prompt's nonce (default: fresh per run, printed; give one to replay prompts)",
    )
    ap.add_argument("--api-key", default="", help="bearer token for both servers (not printed)")
    ap.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (strict OpenAI servers)")
    ap.add_argument("--out", default="", help="output dir (default bench/out/http-<time>)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--roofline-gemm-n", type=int, default=2048, help="matmul size for the FLOP/s ceiling")
    ap.add_argument("--roofline-mem-mib", type=int, default=256, help="array size for the bandwidth ceiling")
    for f in Sizes.__dataclass_fields__.values():
        if f.name != "sweep_levels":
            ap.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default, help="%(default)s")
    return ap


def run(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out or f"bench/out/http-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    sizes = Sizes(
        **{k: getattr(args, k) for k in Sizes.__dataclass_fields__ if k != "sweep_levels"},
        sweep_levels=tuple(int(x) for x in args.levels.split(",")),
    )
    limits = Limits(args.max_requests, args.max_seconds)
    tests = [t for t in args.tests.split(",") if t]
    if args.peer and (args.compare or not args.gguf):
        print("--peer takes --gguf (the file both servers serve) and no --compare", file=sys.stderr)
        return 2
    if args.gguf and not Path(args.gguf).is_file():
        print(f"--gguf {args.gguf}: no such file", file=sys.stderr)
        return 2
    endpoints = asyncio.run(_endpoints(args))
    peer = Peer(PeerSpec(args.peer, args.gguf, args.peer_threads or os.cpu_count() or 1, args.peer_ctx), out)
    pf = PromptFactory(load_tokenizer(args.model_dir), args.seed, args.run_id)
    cases = build_cases(tests, pf, sizes, args.rate, limits)
    bound_s = len(cases) * args.repeats * len(endpoints) * limits.max_seconds
    servers = {k: {**asdict(e), "api_key": "***" if e.api_key else ""} for k, e in endpoints.items()}
    config = {
        "bench": "http",
        "servers": servers,
        "tests": tests,
        "seed": args.seed,
        "run_id": pf.run_id,
        "repeats": args.repeats,
        "rate": args.rate,
        "limits": asdict(limits),
        "sizes": asdict(sizes),
        "model_dir": args.model_dir,
        "gguf": args.gguf,
        "peer": asdict(peer.spec) if args.peer else None,  # its -np: each case's (bench/peer.py slots_for)
        "warmup": args.warmup,
        "out": str(out),
        "worst_case_wall_s": bound_s,
    }
    print("config:", json.dumps(config), flush=True)

    machine = measure_machine(args.roofline_gemm_n, args.roofline_mem_mib << 20)
    cost = _cost(args.gguf or args.model_dir, args.bytes_per_param)
    roof = roofline_line(machine, cost, args.gguf or args.model_dir) + "; " + int8_peak.describe(int8_peak.measure())
    print(roof, flush=True)

    def prepare(case: Case) -> dict[str, Endpoint]:
        url = peer.ensure(slots_for(case, peer.spec))
        return {"B": Endpoint(url, args.gguf, args.api, not args.no_ignore_eos, api_key=args.api_key)}

    try:
        runs = asyncio.run(
            run_interleaved(
                cases,
                endpoints,
                limits,
                args.repeats,
                args.seed,
                on_run=_progress,
                prepare=prepare if args.peer else None,
                warmup=args.warmup,
            )
        )
    except RuntimeError as e:  # the peer did not start (bench/peer.py says why, naming its log)
        print(f"bench http: {e}", file=sys.stderr)
        return 2
    finally:
        peer.stop()
    rows = [summary_row(r, machine, cost) for r in runs]
    ratios = ratio_rows(rows) if len(endpoints) > 1 or args.peer else []
    plots = [] if args.no_plots else write_plots(runs, rows, out)
    write_jsonl(out / "results.jsonl", config, machine, cost, runs, rows, ratios)
    md = report_markdown(config, roof, rows, ratios, plots)
    (out / "report.md").write_text(md)
    print(md)
    return 0


async def _endpoints(args: argparse.Namespace) -> dict[str, Endpoint]:
    pairs = [("A", args.url, args.model)] + ([("B", args.compare, args.compare_model)] if args.compare else [])
    # --peer: B's endpoint comes with each case (run_interleaved's prepare).
    eps = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client:
        for name, url, model in pairs:
            auth = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            model = model or await first_model(client, url, auth)
            eps[name] = Endpoint(url, model, args.api, not args.no_ignore_eos, api_key=args.api_key)
    return eps


def _cost(model_dir: str, bytes_per_param: float) -> ModelCost | None:
    try:
        return load_model_cost(model_dir, bytes_per_param)
    except (OSError, KeyError, ValueError):
        return None


def _progress(run: Run, res: list[RequestResult], wall: float) -> None:
    s = summarize(res, wall)
    print(
        f"  {run.case.label} [{run.server}]: {s['requests']} requests, {s['errors']} errors, "
        f"{s['output_tok_s']:.1f} out tok/s, TTFT p50 {s['ttft_p50_ms']:.1f} ms, {wall:.1f} s",
        flush=True,
    )


def work_rates(run: Run, s: dict[str, float]) -> tuple[float, float]:
    """(tokens/s of model work, steps/s) for the roofline; see the report notes for each test."""
    ok = [r for r in run.results if r.ok]
    if run.case.test == "prefill":
        ttft_s = s["ttft_p50_ms"] / 1e3
        prompt = _mean([r.usage_prompt_tokens or run.case.prompt_tokens for r in ok])
        return prompt / ttft_s, 1 / ttft_s
    if run.case.test == "decode":
        rate = 1e3 / s["tpot_mean_ms"]
        return rate, rate
    if run.wall_s <= 0:
        return math.nan, math.nan
    prompt = sum(r.usage_prompt_tokens or run.case.prompt_tokens for r in ok)
    in_flight = run.in_flight_s / run.wall_s if run.wall_s > 0 else math.nan
    return (prompt + s["output_tokens"]) / run.wall_s, s["output_tok_s"] / max(in_flight, 1.0)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def summary_row(run: Run, machine: Machine, cost: ModelCost | None) -> dict[str, object]:
    s = summarize(run.results, run.wall_s)
    work_tok_s, steps_s = work_rates(run, s)
    row: dict[str, object] = {
        "test": run.case.test,
        "case": run.case.label,
        "server": run.server,
        **s,
        "work_tok_s": work_tok_s,
        "steps_s": steps_s,
    }
    if cost is not None:
        fr = fractions(machine, cost, work_tok_s, steps_s)
        out_fr = fractions(machine, cost, float(s["output_tok_s"]), steps_s)
        row |= {
            "pct_gemm": 100 * fr["flop_frac"],
            "pct_gemm_out": 100 * out_fr["flop_frac"],
            "pct_mem_bw": 100 * fr["bw_frac"],
        }
    return row


def ratio_rows(rows: Sequence[dict[str, object]]) -> list[dict[str, object]]:
    """B/A per case and metric (for times, < 1 means B is faster; for tok/s, > 1 means B is faster)."""
    by = {(r["case"], r["server"]): r for r in rows}
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        a, b = by.get((case, "A")), by.get((case, "B"))
        if a is None or b is None:
            continue
        for m in RATIO_METRICS:
            va, vb = float(a[m]), float(b[m])  # type: ignore[arg-type]
            ratio = vb / va if va and not math.isnan(va) and not math.isnan(vb) else math.nan
            out.append({"case": case, "metric": m, "A": va, "B": vb, "B/A": ratio})
    return out


def ratio_table(ratios: Sequence[dict[str, object]]) -> list[dict[str, object]]:
    """One row per case: A and B output tok/s, then B/A for every ratio metric."""
    rows: dict[object, dict[str, object]] = {}
    for r in ratios:
        row = rows.setdefault(r["case"], {"case": r["case"]})
        if r["metric"] == "output_tok_s":
            row |= {"A out tok/s": _fmt(r["A"]), "B out tok/s": _fmt(r["B"])}
        row[f"{DISPLAY[str(r['metric'])]} B/A"] = _fmt(r["B/A"], 3)
    return list(rows.values())


DISPLAY = {
    "case": "case",
    "server": "server",
    "requests": "requests",
    "errors": "errors",
    "output_tok_s": "out tok/s",
    "request_s": "req/s",
    "ttft_p50_ms": "TTFT p50 ms",
    "ttft_p99_ms": "TTFT p99 ms",
    "itl_p50_ms": "ITL p50 ms",
    "itl_p99_ms": "ITL p99 ms",
    "tpot_mean_ms": "TPOT ms",
    "latency_p50_ms": "e2e p50 ms",
    "work_tok_s": "work tok/s",
    "steps_s": "steps/s",
    "pct_gemm": "% GEMM",
    "pct_gemm_out": "out % GEMM",
    "pct_mem_bw": "% mem BW",
}


def _fmt(v: object, digits: int = 1) -> object:
    if isinstance(v, float):
        return "" if math.isnan(v) else round(v, digits)
    return v


def report_markdown(
    config: dict[str, object],
    roof: str,
    rows: Sequence[dict[str, object]],
    ratios: Sequence[dict[str, object]],
    plots: Sequence[Path],
) -> str:
    table = [{DISPLAY[k]: _fmt(r[k]) for k in DISPLAY if k in r} for r in rows]
    parts = ["# HTTP load benchmark", "", "config: `" + json.dumps(config) + "`", "", roof, "", markdown_table(table)]
    if ratios:
        parts += [
            "",
            "## B / A per case (interleaved A, B, A, B; times < 1 and tok/s > 1 favour B)",
            "",
            markdown_table(ratio_table(ratios)),
        ]
    parts += [
        "",
        "Notes: TTFT = send to first non-empty content delta; ITL = gaps between content deltas; "
        "TPOT = (end - first token) / (tokens - 1); token counts from the usage chunk when sent. "
        "Roofline: prefill work = prompt tokens / TTFT p50, steps/s = 1 / TTFT p50 (one step per prompt; "
        "chunked prefill takes more); decode work = steps/s = "
        "1 / TPOT; other tests: work = (prompt + output tokens) / wall (prefix-cache hits do less), "
        "steps/s = output tok/s / mean in-flight requests (a lower bound). % GEMM counts work tokens, "
        "out % GEMM output tokens only (aggregate decode: prompt tokens computed earn nothing). The load "
        "generator shares the CPU with a local server.",
    ]
    parts += [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(parts) + "\n"


def write_jsonl(
    path: Path,
    config: dict[str, object],
    machine: Machine,
    cost: ModelCost | None,
    runs: Sequence[Run],
    rows: Sequence[dict[str, object]],
    ratios: Sequence[dict[str, object]],
) -> None:
    with path.open("w") as f:

        def put(obj: dict[str, object]) -> None:
            f.write(json.dumps(obj, allow_nan=False, default=str) + "\n")

        put({"kind": "config", **config})
        put(
            {
                "kind": "roofline",
                **asdict(machine),
                **({"model": {**asdict(cost), "flops_per_token": cost.flops_per_token}} if cost else {}),
            }
        )
        for run in runs:
            for r in run.results:
                put({"kind": "request", "case": run.case.label, "server": run.server, **r.to_json()})
        for row in rows:
            put({"kind": "summary", **{k: _json_num(v) for k, v in row.items()}})
        for row in ratios:
            put({"kind": "ratio", **{k: _json_num(v) for k, v in row.items()}})


def _json_num(v: object) -> object:
    return None if isinstance(v, float) and math.isnan(v) else v


def write_plots(runs: Sequence[Run], rows: Sequence[dict[str, object]], out: Path) -> list[Path]:
    from bench.plots import plot_cdfs, plot_throughput

    paths = []
    sweep: dict[str, list[tuple[int, float]]] = {}
    for run, row in zip(runs, rows, strict=False):
        if run.case.test == "sweep":
            tok_s = float(row["output_tok_s"])  # type: ignore[arg-type]
            sweep.setdefault(run.server, []).append((run.case.concurrency, tok_s))
    if sweep:
        paths.append(plot_throughput(sweep, out / "throughput_vs_concurrency.png"))
    for test in dict.fromkeys(r.case.test for r in runs):
        ttft: dict[str, list[float]] = {}
        itl: dict[str, list[float]] = {}
        for run in runs:
            if run.case.test == test:
                ok = [r for r in run.results if r.ok]
                key = f"{run.case.label} [{run.server}]"
                ttft[key] = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
                itl[key] = [g * 1e3 for r in ok for g in r.itl_s]
        panels = {"TTFT ms": ttft} | ({"ITL ms": itl} if any(itl.values()) else {})
        paths.append(plot_cdfs(panels, out / f"latency_cdf_{test}.png", title=f"{test}: latency CDFs"))
    return paths
