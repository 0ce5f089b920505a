"""`python -m bench structured`: structured output under load against the same load unconstrained.

At each concurrency level (default 16 and 64), closed-loop streamed chat requests ask for a
JSON record twice, in turn: with `response_format` json_schema (a realistic schema: nested
objects, enums, arrays, bounds), then the same prompts without it, each made to produce exactly
as many tokens as its constrained twin did (`max_tokens` = that count, `ignore_eos`): the same
load, only unconstrained. With
`--compare URL` a second server (llama.cpp's `llama-server`, which takes the same
response_format) runs the same cases in turn. Reports per server and level: output tok/s of
both loads and their ratio, mean output tokens per request, and the share of constrained
answers that finished with "stop" and validate (the `jsonschema` package). Then, in this
process, over tl/text/grammar.py (the server's own compiler and matcher, the same tokenizer): the
bitmask time per token (p50/p99) replaying the constrained answers, and the compile time per
schema, cold (a fresh schema each time) and cached. Owns orchestration and the figures; the
client is bench/load.py.

Example: `python -m bench structured --url http://127.0.0.1:8000 --compare http://127.0.0.1:8001`
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from bench.load import Endpoint, RequestResult, first_model, percentile, summarize
from bench.load_tests import Job, run_closed

TOPICS = (
    "a famous novel", "a classic film", "a science book", "a history book", "a poetry collection",
    "a mystery novel", "a children's book", "a travel guide",
)  # fmt: skip

SCHEMA: dict[str, object] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "genre": {"enum": ["fiction", "science", "history", "poetry", "travel", "children"]},
        "year": {"type": "integer", "minimum": 1500, "maximum": 2030},
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
        "authors": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "nationality": {"enum": ["American", "British", "French", "German", "Other"]},
                    "alive": {"type": "boolean"},
                },
                "required": ["name", "nationality", "alive"],
                "additionalProperties": False,
            },
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "publisher": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 30}, "city": {"type": "string", "maxLength": 20}},
            "required": ["name", "city"],
            "additionalProperties": False,
        },
    },
    "required": ["title", "genre", "year", "rating", "authors", "tags", "publisher"],
    "additionalProperties": False,
}


def response_format(schema: dict[str, object]) -> dict[str, object]:
    return {"type": "json_schema", "json_schema": {"name": "record", "schema": schema, "strict": True}}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench structured", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="server A base URL (without /v1)")
    ap.add_argument("--compare", default="", help="server B base URL (e.g. llama.cpp's llama-server)")
    ap.add_argument("--levels", default="16,64")
    ap.add_argument("--requests", type=int, default=0, help="requests per run (default: 2 x the level)")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--max-seconds", type=float, default=300.0, help="deadline per run")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--model-dir", default="artifacts/models/smol-135m", help="tokenizer for the in-process figures")
    ap.add_argument("--out", default="", help="output dir (default bench/out/structured-<time>)")
    return ap


def jobs(n: int, run_tag: str) -> list[Job]:
    return [
        Job(f"[{run_tag}-{i}] Describe {TOPICS[i % len(TOPICS)]} as a JSON record.", 0, "You answer in JSON.")
        for i in range(n)
    ]


def validity(results: Sequence[RequestResult]) -> tuple[int, int]:
    """(answers that parse and validate, answers): constrained answers cut by max_tokens count as invalid."""
    import jsonschema

    good = 0
    ok = [r for r in results if r.ok]
    for r in ok:
        try:
            jsonschema.validate(json.loads(r.text), SCHEMA)
            good += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return good, len(ok)


async def measure(
    endpoints: dict[str, Endpoint], levels: Sequence[int], args: argparse.Namespace
) -> tuple[list[dict[str, object]], dict[str, list[RequestResult]]]:
    rows: list[dict[str, object]] = []
    answers: dict[str, list[RequestResult]] = {}
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max(levels) + 8, force_close=True),
        timeout=aiohttp.ClientTimeout(total=args.max_seconds + 10),
    ) as client:
        for level in levels:
            n = args.requests or 2 * level
            for rep in range(args.repeats):
                for name, ep in endpoints.items():
                    row: dict[str, object] = {"server": name, "level": level, "repeat": rep}
                    lengths: list[int] = []
                    for load in ("json", "plain"):
                        tag = f"{time.time_ns() % 10**9}-{name}-{level}-{rep}-{load}"
                        if load == "json":
                            e = dataclasses.replace(
                                ep, extra_body=ep.extra_body + (("response_format", response_format(SCHEMA)),)
                            )
                            js = [dataclasses.replace(j, max_tokens=args.max_tokens) for j in jobs(n, tag)]
                        else:  # the same requests, each made to produce as many tokens as its constrained twin
                            e = dataclasses.replace(ep, ignore_eos=True)
                            js = [
                                dataclasses.replace(j, max_tokens=k)
                                for j, k in zip(jobs(n, tag), lengths, strict=False)
                            ]
                        res, wall = await run_closed(client, e, js, level, args.max_seconds)
                        if load == "json":
                            lengths = [max(1, r.num_output_tokens) if r.ok else args.max_tokens for r in res]
                        s = summarize(res, wall)
                        ok = [r for r in res if r.ok]
                        row[f"{load}_tok_s"] = s["output_tok_s"]
                        row[f"{load}_tokens_mean"] = s["output_tokens"] / max(1, len(ok))
                        row[f"{load}_errors"] = s["errors"]
                        row[f"{load}_itl_p99_ms"] = s["itl_p99_ms"]
                        if load == "json":
                            good, total = validity(res)
                            row["valid"] = f"{good}/{total}"
                            answers.setdefault(name, []).extend(ok)
                        print(f"{name} level {level} {load}: {json.dumps(s)}", flush=True)
                    row["ratio"] = float(row["json_tok_s"]) / float(row["plain_tok_s"])  # type: ignore[arg-type]
                    rows.append(row)
    return rows, answers


def mask_times(texts: Sequence[str], model_dir: str) -> dict[str, float]:
    """Bitmask fill time per token over the constrained answers, re-tokenized and replayed
    through the server's matcher (tl/text/grammar.py), in this process."""
    import numpy as np

    from tl.core.request import ConstraintSpec
    from tl.model.config import load_model_config
    from tl.model.files import eos_token_ids
    from tl.text.grammar import GrammarCompiler
    from tl.text.tokenizer import Tokenizer

    cfg = load_model_config(model_dir)
    g = GrammarCompiler.from_model_dir(model_dir, cfg.vocab_size, eos_token_ids(model_dir), 4, 60.0)
    grammar = g.compile(ConstraintSpec("json", json.dumps(SCHEMA), "bench")).grammar
    tok = Tokenizer.load(model_dir)
    mask = np.zeros((1, g.mask_words), np.int32)
    times: list[float] = []
    for text in texts:
        m = grammar.matcher()
        for t in tok.encode(text):
            t0 = time.perf_counter()
            m.fill(mask, 0, ())
            times.append(time.perf_counter() - t0)
            if not m.accept(t):
                break
    return {
        "tokens": len(times),
        "p50_us": percentile(times, 50) * 1e6,
        "p99_us": percentile(times, 99) * 1e6,
        "mean_us": (sum(times) / len(times) * 1e6) if times else math.nan,
    }


def compile_times(model_dir: str, n: int = 5) -> dict[str, float]:
    """Compile time of the bench schema: cold (each time a schema never seen: its description
    differs) and cached (the same text again), through tl/text/grammar.py's compiler."""
    from tl.core.request import ConstraintSpec
    from tl.model.config import load_model_config
    from tl.model.files import eos_token_ids
    from tl.text.grammar import GrammarCompiler

    cfg = load_model_config(model_dir)
    g = GrammarCompiler.from_model_dir(model_dir, cfg.vocab_size, eos_token_ids(model_dir), 64, 60.0)
    g.tokenizer()
    cold, cached = [], []
    for i in range(n):
        spec = ConstraintSpec("json", json.dumps({**SCHEMA, "description": f"run {i}"}), "bench")
        t0 = time.perf_counter()
        g.compile(spec)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert g.compile(spec).cached
        cached.append(time.perf_counter() - t0)
    return {"cold_p50_ms": percentile(cold, 50) * 1e3, "cold_max_ms": max(cold) * 1e3,
            "cached_p50_us": percentile(cached, 50) * 1e6}  # fmt: skip


async def _endpoints(args: argparse.Namespace) -> dict[str, Endpoint]:
    out = {}
    async with aiohttp.ClientSession() as client:
        for name, url in (("A", args.url), ("B", args.compare)):
            if url:
                out[name] = Endpoint(url, await first_model(client, url), api="chat", ignore_eos=False)
    return out


def run(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out or f"bench/out/structured-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    levels = [int(x) for x in args.levels.split(",")]
    endpoints = asyncio.run(_endpoints(args))
    config = {"bench": "structured", "servers": {k: dataclasses.asdict(e) for k, e in endpoints.items()},
              "levels": levels, "max_tokens": args.max_tokens, "repeats": args.repeats, "schema": SCHEMA}  # fmt: skip
    print("config:", json.dumps(config), flush=True)
    rows, answers = asyncio.run(measure(endpoints, levels, args))
    masks = mask_times([r.text for r in answers.get("A", [])], args.model_dir)
    compiles = compile_times(args.model_dir)
    lines = [
        "| server | streams | json tok/s | plain tok/s | json/plain | json tokens/req | plain tokens/req | valid |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['server']} | {r['level']} | {float(r['json_tok_s']):.1f} | {float(r['plain_tok_s']):.1f} | "  # type: ignore[arg-type]
            f"{float(r['ratio']):.3f} | {float(r['json_tokens_mean']):.0f} | {float(r['plain_tokens_mean']):.0f} | "  # type: ignore[arg-type]
            f"{r['valid']} |"
        )
    lines.append("")
    lines.append(f"mask per token (A's answers replayed, {masks['tokens']} tokens): p50 {masks['p50_us']:.1f} us, "
                 f"p99 {masks['p99_us']:.1f} us, mean {masks['mean_us']:.1f} us")  # fmt: skip
    lines.append(f"compile per schema: cold p50 {compiles['cold_p50_ms']:.1f} ms (max {compiles['cold_max_ms']:.1f}), "
                 f"cached p50 {compiles['cached_p50_us']:.1f} us")  # fmt: skip
    md = "\n".join(lines)
    (out / "report.md").write_text(md + "\n")
    with (out / "results.jsonl").open("w") as f:
        for obj in ({"config": config}, *({"row": r} for r in rows), {"mask": masks}, {"compile": compiles}):
            f.write(json.dumps(obj) + "\n")
    print(md)
    return 0
