"""Greedy equality of the accelerator path with the CPU path on SmolLM2 (fp32 and bf16).

Runs a few chat prompts through the Engine twice per dtype, backend="cpu" and backend=<accel>
(attention kernel "auto": Pallas on the accelerator), and prints, per prompt, the first
position where the greedy tokens differ. fp32 must match exactly (exit 1 otherwise); bf16 is
reported only (bf16 rounding differs across platforms, so long greedy runs may drift).
Run by bench/gpu_check.sh; `python -m bench.gpu_check --backend gpu`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tl.config import EngineConfig
from tl.request import GenRequest, SamplingParams

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Count to ten.",
           "Explain what a paged KV cache is in one sentence."]


def _greedy(cfg: EngineConfig, max_tokens: int) -> tuple[list[list[int]], str]:
    from tl.chat_template import ChatTemplate
    from tl.engine import Engine
    from tl.runner import ModelRunner
    from tl.tokenizer import Tokenizer

    tok, tpl = Tokenizer.load(cfg.model_dir), ChatTemplate.from_model_dir(cfg.model_dir)
    runner = ModelRunner.from_model_dir(cfg)
    engine = Engine(runner, cfg)
    ids = [engine.add_request(GenRequest(tuple(tok.encode(tpl.render([{"role": "user", "content": p}]))),
                                         SamplingParams(temperature=0.0, max_tokens=max_tokens))) for p in PROMPTS]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_work():
        for out in engine.step():
            if out.token_id >= 0:
                tokens[out.request_id].append(out.token_id)
    return [tokens[i] for i in ids], runner.backend_info.attention_kernel


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="artifacts/models/smol-135m")
    ap.add_argument("--backend", default="gpu")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    base = EngineConfig(model_dir=args.model, num_kv_blocks=256, max_num_seqs=4, max_num_batched_tokens=256,
                        token_buckets=(16, 64, 256), seq_buckets=(1, 4), prefill_chunk=256, compile_cache_dir="")
    ok = True
    for dtype in ("float32", "bfloat16"):
        t0 = time.perf_counter()
        cpu, _ = _greedy(base.replace(backend="cpu", dtype=dtype), args.max_tokens)
        acc, kernel = _greedy(base.replace(backend=args.backend, dtype=dtype), args.max_tokens)
        first_diff = [next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b),
                           None if len(x) == len(y) else min(len(x), len(y))) for x, y in zip(cpu, acc, strict=True)]
        same = all(d is None for d in first_diff)
        print(json.dumps({"check": "greedy_vs_cpu", "dtype": dtype, "backend": args.backend, "attention": kernel,
                          "identical": same, "first_diff_per_prompt": first_diff,
                          "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
        ok &= same or dtype == "bfloat16"
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
