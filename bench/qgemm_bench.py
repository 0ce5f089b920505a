"""The native quantized matmul (kernels/cpu_native.py `qgemm`) at a real model's shapes, by rows.

One layer's linears of a named shape (bench/synth_shapes.py: q, k, v, o, gate, up, down), random
weights quantized to `--format` with bench/kquants.py / gguf-py, `--copies` distinct copies so
the weights stream from memory as in a step (default: enough to pass 128 MB), chained so that
each call waits for the last. For each row count: the median time of one pass over every copy,
timed in turn with the other row counts (rows 1, 2, 4, ... alternate, so machine noise hits
all), and what it means: weight GB/s read, int8 multiply-adds a second, and the cost against one
row (16 rows at 1.0x: free; at 16x: no reuse at all). Prints the config, the CPU and the build.
Run: `python -m bench qgemm [--shape llama3.2-1b] [--format q4_k] [--rows 1,2,4,8,16,32,64]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence

from bench.report import print_table

FORMATS = ("q4_k", "q5_k", "q6_k", "q8_0", "q4_0", "q4_1")


def run(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench qgemm")
    ap.add_argument("--shape", default="llama3.2-1b", help="a bench/synth_shapes.py shape")
    ap.add_argument("--format", default="q4_k", choices=FORMATS)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--copies", type=int, default=0, help="layers of weights (0: enough for 128 MB)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", default="auto", help="native build (kernels/cpu_build.py TARGETS)")
    args = ap.parse_args(argv)

    import gguf
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench import kquants, synth_shapes
    from kernels import cpu_build, cpu_native

    shape = synth_shapes.SHAPES[args.shape]
    d, hd, f = shape.hidden_size, shape.head_dim, shape.intermediate_size
    mats = {  # [out, in]
        "q": (shape.num_heads * hd, d),
        "k": (shape.num_kv_heads * hd, d),
        "v": (shape.num_kv_heads * hd, d),
        "o": (d, shape.num_heads * hd),
        "gate": (f, d),
        "up": (f, d),
        "down": (d, f),
    }
    qtype = gguf.GGMLQuantizationType[args.format.upper()]
    block, size = cpu_native.QUANT_KINDS[args.format][1:]
    layer_bytes = sum(o * i // size * block for o, i in mats.values())
    copies = args.copies or max(1, -(-(128 << 20) // layer_bytes))
    rows = [int(r) for r in args.rows.split(",")]
    print("config:", json.dumps({**vars(args), "copies": copies, "layer_mb": round(layer_bytes / 1e6, 1)}))
    lib = cpu_native.library(args.target)
    print("native build:", lib.target.name, "on", cpu_build.cpu_model())

    rng = np.random.default_rng(args.seed)
    # One layer quantized, then copies of its bytes with the scales' high bits intact: distinct
    # memory to stream, the same arithmetic.
    layer = {
        name: kquants.quantize_rows(rng.standard_normal((o, i), dtype=np.float32) / np.sqrt(i), qtype)
        for name, (o, i) in mats.items()
    }
    ws = [{name: jnp.asarray(w.copy()) for name, w in layer.items()} for _ in range(copies)]

    def mm(x: jax.Array, w: jax.Array) -> jax.Array:
        y = lib.qgemm(x, w, args.format)
        assert y is not None, f"the native kernel does not take [{w.shape}] at {x.shape[0]} rows"
        return y

    def chain(ws: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
        for w in ws:  # a layer's data flow: each call waits for the one before
            q, k, v = mm(x, w["q"]), mm(x, w["k"]), mm(x, w["v"])
            x = x + 1e-3 * mm(q, w["o"]) + 1e-6 * (k[:, :1] + v[:, :1])
            x = x + 1e-3 * mm(jax.nn.silu(mm(x, w["gate"])) * mm(x, w["up"]), w["down"])
        return x

    fn = jax.jit(chain)
    xs = {n: jnp.asarray(rng.standard_normal((n, d), dtype=np.float32)) for n in rows}
    for n in rows:
        jax.block_until_ready(fn(ws, xs[n]))
    times: dict[int, list[float]] = {n: [] for n in rows}
    for _ in range(args.repeat):
        for n in rows:
            t0 = time.perf_counter()
            jax.block_until_ready(fn(ws, xs[n]))
            times[n].append(time.perf_counter() - t0)
    med = {n: statistics.median(v) for n, v in times.items()}
    macs = copies * sum(o * i for o, i in mats.values())
    table = [
        {
            "rows": n,
            "ms a layer": f"{med[n] / copies * 1e3:.2f}",
            "weight GB/s": f"{copies * layer_bytes / med[n] / 1e9:.1f}",
            "int8 GMAC/s": f"{n * macs / med[n] / 1e9:.0f}",
            "cost / one row": f"{med[n] / med[rows[0]]:.2f}x",
        }
        for n in rows
    ]
    print_table(table)
    return 0
