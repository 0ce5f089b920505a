"""Quality of a GGUF served as it is: KL divergence from the float32 model of the same file, as
llama.cpp's `llama-perplexity --kl-divergence` measures it, on the same text, side by side.

tl: the text tokenized by the model's tokenizer, cut into chunks of `--ctx` tokens; each chunk
teacher-forced through the dense forward twice, over the GGUF's weights as they are and over
the same values dequantized to float32 (tl/model/files.py `Packed.to_float`); at positions
ctx/2 .. ctx-2 of each chunk (llama-perplexity's scored half) KL(p_float || p_quant) over the
vocabulary, and whether the argmax agrees (llama.cpp's "Same top p"). Two quantized paths:
"xla" (the weights dequantized inside the step: the path of steps of more than 64 rows, so of
prefill) and "integer" (every matmul through the native integer-dot kernel, the activations
quantized per block of 32 to int8: the decode path; rows fed 64 at a time).
llama.cpp (with `--llama-bin DIR`): `llama-quantize --allow-requantize` makes the F32 file of
the GGUF, `llama-perplexity --kl-divergence-base` saves its logits on the same text (`-c ctx`,
`-t 2`), `--kl-divergence` scores the GGUF against them; its mean KLD and same-top-p are read
from its output.
Run: `python -m bench kl --gguf smol-q4_1.gguf --text FILE [--llama-bin DIR]`.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.report import print_table


def run(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench kl")
    ap.add_argument("--gguf", required=True, help="the GGUF served as it is")
    ap.add_argument("--text", required=True, help="a text file (at least chunks * ctx tokens)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--llama-bin", default="", help="directory of llama-quantize and llama-perplexity")
    args = ap.parse_args(argv)
    print("config:", json.dumps(vars(args)))
    keys = ["who", "positions", "mean KLD", "max KLD", "same top-1 %"]
    rows = []
    for measure in [_tl_xla, _tl_integer] + ([_llama_cpp] if args.llama_bin else []):
        rows.append(dict(zip(keys, measure(args), strict=True)))
        print(rows[-1], flush=True)
    print_table(rows)
    return 0


def _tl_xla(args: argparse.Namespace) -> list[Any]:
    return _tl(args, "xla")


def _tl_integer(args: argparse.Namespace) -> list[Any]:
    return _tl(args, "integer")


def _tl(args: argparse.Namespace, path: str) -> list[Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels import cpu_native
    from tl.model import llama, loader
    from tl.model.config import load_model_config
    from tl.model.convert_gguf import model_dir_of
    from tl.model.encodings.blocks import Blocks
    from tl.model.files import read_tensors
    from tl.model.gguf_model import Packed
    from tl.text.tokenizer import Tokenizer

    d = model_dir_of(args.gguf)
    cfg = load_model_config(d)
    packed = read_tensors(d, packed=True)
    floats = {k: v.to_float() if isinstance(v, Packed) else v for k, v in packed.items()}
    wq = loader.load_weights(packed, cfg, weight_dtype="auto")
    wf = loader.load_weights(floats, cfg)
    ids = Tokenizer.load(d).encode(Path(args.text).read_text())
    need = args.chunks * args.ctx
    if len(ids) < need:
        raise SystemExit(f"{args.text}: {len(ids)} tokens, {need} needed ({args.chunks} chunks of {args.ctx})")
    matmul: Callable[[jax.Array, Any], jax.Array | None] | None = None
    if path == "integer":
        lib = cpu_native.library()

        def matmul(x: jax.Array, w: Any) -> jax.Array | None:
            if not isinstance(w, Blocks):
                return None
            parts = [lib.qgemm(x[i : i + 64], w.data, w.fmt.name) for i in range(0, x.shape[0], 64)]
            if any(p is None for p in parts):
                return None
            return jnp.concatenate(parts)

    quant = jax.jit(lambda p, t: llama.forward_dense(p, cfg, t, matmul)[1])
    ref = jax.jit(lambda p, t: llama.forward_dense(p, cfg, t)[1])
    kls, same = [], []
    for c in range(args.chunks):
        t = jnp.asarray(ids[c * args.ctx : (c + 1) * args.ctx], jnp.int32)
        lq = jax.nn.log_softmax(np.asarray(quant(wq, t), np.float64)[args.ctx // 2 : args.ctx - 1], axis=-1)
        lf = jax.nn.log_softmax(np.asarray(ref(wf, t), np.float64)[args.ctx // 2 : args.ctx - 1], axis=-1)
        lq, lf = np.asarray(lq), np.asarray(lf)
        kls.append((np.exp(lf) * (lf - lq)).sum(-1))
        same.append(lf.argmax(-1) == lq.argmax(-1))
    kl, agree = np.concatenate(kls), np.concatenate(same)
    return [f"tl {path}", len(kl), f"{kl.mean():.6f}", f"{kl.max():.4f}", f"{100 * agree.mean():.2f}"]


def _llama_cpp(args: argparse.Namespace) -> list[Any]:
    b = Path(args.llama_bin)
    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "f32.gguf"
        quantize = [b / "llama-quantize", "--allow-requantize", args.gguf, f32, "F32"]
        subprocess.run(quantize, check=True, capture_output=True)
        base = Path(tmp) / "base.kld"
        common = ["-f", args.text, "-c", str(args.ctx), "--chunks", str(args.chunks), "-t", "2", "-b", str(args.ctx)]
        save = [b / "llama-perplexity", "-m", f32, *common, "--kl-divergence-base", base]
        subprocess.run(save, check=True, capture_output=True)
        out = subprocess.run(
            [b / "llama-perplexity", "-m", args.gguf, *common, "--kl-divergence-base", base, "--kl-divergence"],
            check=True,
            capture_output=True,
            text=True,
        )
    text = out.stdout + out.stderr
    mean = re.search(r"Mean\s+KLD:\s+([\d.eE+-]+)", text)
    top = re.search(r"Same top p:\s+([\d.]+)", text)
    mx = re.search(r"Maximum KLD:\s+([\d.eE+-]+)", text)
    positions = args.chunks * (args.ctx - 1 - args.ctx // 2)
    return [
        "llama.cpp",
        positions,
        mean.group(1) if mean else "?",
        mx.group(1) if mx else "?",
        top.group(1) if top else "?",
    ]
