"""Kernel benchmark: the native CPU kernels (kernels/cpu_native.py) against XLA, in isolation.

Random weights and caches with SmolLM2-135M's shapes (30 layers, hidden 576, FFN 1536, 9 query
and 3 KV heads of 64, block 16), each op chained over the 30 layers so that one layer waits for
the last, as in a step. Measures: paged attention (jnp reference vs cpu_native, and cpu_native
over a bf16 cache vs a float32 one) at a batch of decoding sequences, and the layers' matmuls
(XLA's dot vs the native kernel) at 1-64 rows, float32, and one row int8. Each pair is timed
alternately in one process; prints the config, a Markdown table and the ratios. Run: `python -m bench kernels`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.report import print_table

L, D, F, HQ, HK, HD, BS = 30, 576, 1536, 9, 3, 64, 16


def _alternate(fns: dict[str, Callable[[], Any]], repeat: int) -> dict[str, float]:
    """Median seconds of each fn, timed in turn (first call, the compile, not counted)."""
    import jax

    for fn in fns.values():
        jax.block_until_ready(fn())
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _attention_case(batch: int, context: int, seed: int, layers: int = L) -> tuple[Any, ...]:
    import jax.numpy as jnp
    import numpy as np

    from kernels.paged_attention import AttnMetadata, cache_shape

    rng = np.random.default_rng(seed)
    per_seq = context // BS + 1
    nb = batch * per_seq + 1
    k = jnp.asarray(rng.standard_normal(cache_shape("k", layers, nb, BS, HK, HD), dtype=np.float32))
    v = jnp.asarray(rng.standard_normal(cache_shape("v", layers, nb, BS, HK, HD), dtype=np.float32))
    tables = jnp.asarray(rng.permutation(nb - 1)[: batch * per_seq].reshape(batch, per_seq).astype(np.int32))
    meta = AttnMetadata(
        seq_idx=jnp.arange(batch, dtype=jnp.int32),
        positions=jnp.full(batch, context, jnp.int32),
        start_pos=jnp.full(batch, context, jnp.int32),
        block_tables=tables,
    )
    q = jnp.asarray(rng.standard_normal((batch, HQ, HD), dtype=np.float32))
    kv_new = jnp.asarray(rng.standard_normal((batch, HK, HD), dtype=np.float32))
    return q, kv_new, k, v, meta


def _attention_chain(attention: Callable[..., Any], layers: int = L) -> Callable[..., Any]:
    import jax
    import jax.numpy as jnp

    from kernels.paged_attention import AttnArgs

    def chain(q: Any, kv_new: Any, k: Any, v: Any, meta: Any) -> Any:
        for layer in range(layers):  # each layer's query depends on the last layer's output
            q = q + 1e-3 * attention(AttnArgs(q, kv_new, kv_new, k, v, jnp.int32(layer), meta))
        return q

    return jax.jit(chain)


def _linear_chain(matmul: Any) -> Callable[..., Any]:
    import jax

    from tl.model import llama

    def chain(ws: list[dict[str, Any]], x: Any) -> Any:
        for w in ws:
            h = llama.linear(x, w["qkv"], matmul)
            x = x + 0.01 * llama.linear(h[:, : HQ * HD], w["o"], matmul)
            g = llama.linear(x, w["gu"], matmul)
            x = x + 0.01 * llama.linear(jax.nn.silu(g[:, :F]) * g[:, F:], w["d"], matmul)
        return x

    return jax.jit(chain)


def _weights(int8: bool, seed: int, layers: int = L) -> list[dict[str, Any]]:
    import jax.numpy as jnp
    import numpy as np

    from tl.model.encodings.int8 import quantize_int8
    from tl.model.weights import Dense, Int8

    rng = np.random.default_rng(seed)

    def w(i: int, o: int) -> Any:
        x = rng.standard_normal((o, i), dtype=np.float32) / np.sqrt(i)  # [out, in], as llama.linear takes it
        if not int8:
            return Dense(jnp.asarray(x))
        q, scale = quantize_int8(x)
        return Int8(jnp.asarray(q), jnp.asarray(scale))

    return [
        {"qkv": w(D, (HQ + 2 * HK) * HD), "o": w(HQ * HD, D), "gu": w(D, 2 * F), "d": w(F, D)} for _ in range(layers)
    ]


def run(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench kernels")
    ap.add_argument("--batch", type=int, default=64, help="decoding sequences in the attention test")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64", help="rows of the float32 matmul tests")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=L, help="layers each chain runs (SmolLM2's 30; fewer: a quick check)")
    ap.add_argument(
        "--target", default="auto", help="native build (kernels/cpu_build.py TARGETS); auto: the best this CPU runs"
    )
    args = ap.parse_args(argv)
    print("config:", json.dumps({**vars(args), "shapes": "SmolLM2-135M"}))

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels import cpu_build, cpu_native, paged_attention

    lib = cpu_native.library(args.target)
    print("native build:", lib.target.name, "on", cpu_build.cpu_model())
    rows: list[dict[str, object]] = []

    def add(test: str, med: dict[str, float], xla: str, native: str) -> None:
        rows.append(
            {
                "test": test,
                "baseline": xla,
                "baseline ms": round(med[xla] * 1e3, 2),
                "native ms": round(med[native] * 1e3, 2),
                "native speed-up": round(med[xla] / med[native], 2),
            }
        )

    case = _attention_case(args.batch, args.context, args.seed, args.layers)
    ref = _attention_chain(paged_attention.paged_attention, args.layers)
    nat = _attention_chain(lib.paged_attention, args.layers)
    med = _alternate({"reference": lambda: ref(*case), "native": lambda: nat(*case)}, args.repeat)
    add(f"attention, {args.batch} seqs @ctx {args.context}", med, "reference", "native")
    q, kv_new, k, v, meta = case
    bits = [jax.lax.bitcast_convert_type(c.astype(jnp.bfloat16), jnp.uint16) for c in (k, v)]
    med = _alternate(
        {"native, float32 cache": lambda: nat(*case), "bf16": lambda: nat(q, kv_new, *bits, meta)}, args.repeat
    )
    add(f"attention, bf16 cache, {args.batch} seqs @ctx {args.context}", med, "native, float32 cache", "bf16")

    rng = np.random.default_rng(args.seed)
    for int8, row_counts in ((False, [int(r) for r in args.rows.split(",")]), (True, [1])):
        ws = _weights(int8, args.seed, args.layers)
        xla, nat_mm = _linear_chain(None), _linear_chain(lib.matmul)
        for n in row_counts:
            x = jnp.asarray(rng.standard_normal((n, D), dtype=np.float32))
            med = _alternate(
                {"xla": lambda x=x, f=xla, ws=ws: f(ws, x), "native": lambda x=x, f=nat_mm, ws=ws: f(ws, x)},
                args.repeat,
            )
            add(f"layer matmuls {'int8' if int8 else 'float32'}, {n} row{'s' if n > 1 else ''}", med, "xla", "native")
    if lib.amx_available():  # matmul_precision "high": against the float32 path the runner would take
        ws = _weights(False, args.seed, args.layers)
        high = [
            {k: {"f32": w, "bf16x3": jnp.asarray(cpu_native.pack_bf16x3(np.asarray(w)))} for k, w in lw.items()}
            for lw in ws
        ]
        for n in [int(r) for r in args.rows.split(",")] + [512]:
            x = jnp.asarray(rng.standard_normal((n, D), dtype=np.float32))
            base = "native float32" if n <= lib.max_rows() else "xla"
            med = _alternate(
                {
                    base: lambda x=x, f=nat_mm if base != "xla" else xla: f(ws, x),
                    "high": lambda x=x, f=nat_mm: f(high, x),
                },
                args.repeat,
            )
            add(f"layer matmuls high (bf16x3, AMX), {n} rows", med, base, "high")
    print_table(rows)
    return 0
