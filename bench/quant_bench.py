"""A lower-precision variant vs float32: quality on a fixed prompt set and decode speed, side by side.

Variants (`--variant`): "int8" (weight_dtype int8: linears and embedding), "kv-bf16"
(kv_cache_dtype bfloat16: float32 weights, the KV cache as bf16) and "high" (matmul_precision
high: float32 matmuls as three bf16 products on AMX).
Quality: for each prompt (fixed texts, tokenized with the model's tokenizer), the logits of
every position in both: for int8 the dense forward; for kv-bf16 the runner fed one prompt token
a step, so that each position reads all earlier keys from the cache; for high the dense forward
over the prompt padded to 64 tokens with each runner's own matmuls (64 rows: the AMX kernel's,
where one-row steps would take the float32 one). Reports teacher-forced greedy agreement
(argmax equal at each position), greedy continuation agreement (first N generated tokens
equal; runner path, for high the padded dense forward per token) and max |Δlogit|.
Speed: the runner's decode step at each batch (every sequence decoding at a fixed context),
float32 and the variant interleaved in one process so machine noise hits both. Prints its config.
Run: `python -m bench quant [--variant kv-bf16]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence

from bench.report import print_table

VARIANTS: dict[str, dict[str, str]] = {
    "int8": {"weight_dtype": "int8"},
    "kv-bf16": {"kv_cache_dtype": "bfloat16"},
    "high": {"matmul_precision": "high"},
}
PROMPTS = (
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea, there lived",
    "Photosynthesis is the process by which plants",
    "To make a cup of tea, first",
    "The three primary colors are",
    "import numpy as np\n\nx = np.arange(10)\nprint(",
    "Q: What is 12 times 7?\nA:",
)


def run(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench quant")
    ap.add_argument("--model", default="artifacts/models/smol-135m")
    ap.add_argument("--variant", default="int8", choices=list(VARIANTS))
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--gen", type=int, default=16, help="greedy tokens generated per prompt")
    ap.add_argument("--repeat", type=int, default=6)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    print("config:", json.dumps({**vars(args), "prompts": len(PROMPTS)}))

    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench.runner_bench import _decode_plan
    from tl.core.config import EngineConfig
    from tl.core.plan import SchedulerOutput, SeqWork
    from tl.core.request import SamplingParams
    from tl.model import llama
    from tl.runtime.runner import ModelRunner
    from tl.text.tokenizer import Tokenizer

    bs = 16
    blocks = max(batches) * ((args.context + bs) // bs + 1) + 64
    base = EngineConfig(
        model_dir=args.model,
        num_kv_blocks=blocks,
        block_size=bs,
        max_num_seqs=max(batches),
        seq_buckets=tuple(sorted({1} | set(batches))),
        token_buckets=tuple(sorted(set(batches) | {1, 64})),
        max_num_batched_tokens=64,
        prefill_chunk=64,
    )
    v = args.variant
    runners = {"float32": ModelRunner.from_model_dir(base), v: ModelRunner.from_model_dir(base.replace(**VARIANTS[v]))}
    mc = runners["float32"].model_config
    tok = Tokenizer.load(args.model)
    dense = jax.jit(llama.forward_dense, static_argnums=(1, 3))

    def padded_logits(r: ModelRunner, ids: list[int]) -> np.ndarray:
        pad = np.zeros(64, np.int32)
        pad[: len(ids)] = ids
        matmul = r.kernels.matmul.fn if v == "high" else None
        return np.asarray(dense(r.params, mc, jnp.asarray(pad), matmul)[1])[: len(ids)]

    def position_logits(r: ModelRunner, ids: list[int]) -> np.ndarray:
        if v in ("int8", "high"):
            return padded_logits(r, ids)
        return np.concatenate(
            [r.logits(SchedulerOutput((_step(ids, i, SeqWork, SamplingParams),))) for i in range(len(ids))]
        )

    agree = total = gen_agree = gen_total = 0
    max_diff = 0.0
    for text in PROMPTS:
        ids = list(tok.encode(text))
        logits = {wd: position_logits(r, ids) for wd, r in runners.items()}
        agree += int((logits["float32"].argmax(-1) == logits[v].argmax(-1)).sum())
        total += len(ids)
        max_diff = max(max_diff, float(np.abs(logits["float32"] - logits[v]).max()))
        if v == "high":
            outs = {wd: _greedy_dense(lambda t, r=r: padded_logits(r, t), ids, args.gen) for wd, r in runners.items()}
        else:
            outs = {
                wd: _greedy(r, ids, args.gen, SchedulerOutput, SeqWork, SamplingParams) for wd, r in runners.items()
            }
        gen_agree += _common_prefix(outs["float32"], outs[v])
        gen_total += args.gen
    print_table(
        [
            {
                "variant": v,
                "prompts": len(PROMPTS),
                "positions": total,
                "teacher-forced greedy agreement": round(agree / total, 4),
                "greedy continuation tokens equal (prefix)": f"{gen_agree}/{gen_total}",
                "max |Δlogit|": round(max_diff, 3),
            }
        ]
    )

    rows = []
    for b in batches:
        plan = _decode_plan(b, args.context, bs, mc.vocab_size)
        times: dict[str, list[float]] = {wd: [] for wd in runners}
        for r in runners.values():
            r.execute(plan)
        for _ in range(args.repeat):
            for wd, r in runners.items():
                t0 = time.perf_counter()
                r.execute(plan)
                times[wd].append(time.perf_counter() - t0)
        med = {wd: statistics.median(ts) for wd, ts in times.items()}
        rows.append(
            {
                "test": f"decode batch {b} @ctx {args.context}",
                "float32 tok/s": round(b / med["float32"], 1),
                f"{v} tok/s": round(b / med[v], 1),
                f"{v} / float32": round(med["float32"] / med[v], 2),
            }
        )
    print_table(rows)
    return 0


def _step(ids: list[int], i: int, sw: type, sp: type) -> object:
    """Token i of ids as a one-token step over positions < i in the cache (blocks 0, 1, ...)."""
    return sw(
        seq_id=0,
        token_ids=(ids[i],),
        start_pos=i,
        block_table=tuple(range(i // 16 + 1)),
        sample=True,
        params=sp(temperature=0.0),
        seed=0,
        num_generated=0,
    )


def _greedy(runner: object, prompt: list[int], n: int, so: type, sw: type, sp: type) -> list[int]:
    """n greedy tokens through the runner (one prefill step, then one decode step per token)."""
    from tl.runtime.runner import ModelRunner

    assert isinstance(runner, ModelRunner)
    table = tuple(range((len(prompt) + n + 15) // 16))
    ids, out, start = list(prompt), [], 0
    params = sp(temperature=0.0)
    for _ in range(n):
        w = sw(
            seq_id=0,
            token_ids=tuple(ids[start:]),
            start_pos=start,
            block_table=table,
            sample=True,
            params=params,
            seed=0,
            num_generated=len(out),
        )
        res = runner.execute(so((w,))).results[0]
        start = len(ids)
        ids.append(res.token_ids[0])
        out.append(res.token_ids[0])
    return out


def _greedy_dense(logits: object, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens, each the argmax of the last position's logits(ids) (ids within 64 tokens)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(logits(ids)[-1].argmax()))  # type: ignore[operator]
    return ids[len(prompt) :]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
