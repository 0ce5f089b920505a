"""Greedy equality of the accelerator path with the CPU path, on models built here.

No model hub and no room to carry SmolLM2's weights to a lent GPU machine, so the check builds its
models (tests/helpers/models.py): the successor-byte model (hand-checkable, logit margin 16: greedy must
be identical in fp32 and bf16), a random 2-layer Llama, and a random-weight model of SmolLM2-135M's
exact shape (the one `bench runner` times; `--make-smol DIR` writes it and exits). Each model runs
a few prompts through the Engine with backend="cpu" and backend=<accel> (attention "auto": the
Pallas kernel on the accelerator), and one JSON line per (model, dtype) gives the first position
where the greedy tokens differ per prompt. Random weights give near-tied logits, so on those a
difference is reported, not failed (the accelerator's fp32 matmuls may round differently).
Exit 1 when the successor model differs. Run by bench/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from tl.core.config import EngineConfig
from tl.core.request import GenRequest, SamplingParams
from tl.model.config import ModelConfig

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Count to ten.",
    "Explain what a paged KV cache is in one sentence.",
]
SMOL_SHAPE = dict(
    architecture="LlamaForCausalLM",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    attention_bias=False,
    bos_token_id=1,
    eos_token_ids=(2,),
)


def make_smol_shaped(path: Path) -> Path:
    """A random-weight model dir of SmolLM2-135M's shape (byte tokenizer; projections of std 0.02)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from models import CHATML_TEMPLATE, _write_dir, tiny_tensors

    cfg = ModelConfig(**SMOL_SHAPE)  # type: ignore[arg-type]
    return _write_dir(
        path,
        cfg,
        tiny_tensors(cfg, std=0.02),
        sharded=False,
        bos="<|im_start|>",
        eos="<|im_end|>",
        chat_template=CHATML_TEMPLATE,
    )


def _greedy(cfg: EngineConfig, max_tokens: int) -> tuple[list[list[int]], str]:
    from tl.core.engine import Engine
    from tl.runtime.runner import ModelRunner
    from tl.text.chat_template import ChatTemplate
    from tl.text.tokenizer import Tokenizer

    tok, tpl = Tokenizer.load(cfg.model_dir), ChatTemplate.from_model_dir(cfg.model_dir)
    runner = ModelRunner.from_model_dir(cfg)
    engine = Engine(runner, cfg)
    ids = [
        engine.add_request(
            GenRequest(
                tuple(tok.encode(tpl.render([{"role": "user", "content": p}]))),
                SamplingParams(temperature=0.0, max_tokens=max_tokens),
            )
        )
        for p in PROMPTS
    ]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_work():
        for out in engine.step():
            if out.token_id >= 0:
                tokens[out.request_id].append(out.token_id)
    return [tokens[i] for i in ids], runner.backend_info.attention_kernel


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check")
    ap.add_argument("--backend", default="gpu")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--smol", default="", help="a SmolLM2-shaped model dir to check too (made by --make-smol)")
    ap.add_argument("--make-smol", default="", help="write a random SmolLM2-shaped model dir here and exit")
    args = ap.parse_args()
    if args.make_smol:
        print("wrote", make_smol_shaped(Path(args.make_smol)))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from models import make_succ, make_tiny_llama

    tmp = Path(tempfile.mkdtemp(prefix="tl-gpu-check-"))
    models = {"succ": make_succ(tmp / "succ"), "tiny": make_tiny_llama(tmp / "tiny")}
    if args.smol:
        models["smol_shaped"] = Path(args.smol)
    ok = True
    for name, path in models.items():
        base = EngineConfig(
            model_dir=str(path),
            num_kv_blocks=256,
            max_num_seqs=4,
            max_num_batched_tokens=256,
            token_buckets=(16, 64, 256),
            seq_buckets=(1, 4),
            prefill_chunk=256,
            compile_cache_dir="",
        )
        for dtype in ("float32", "bfloat16"):
            t0 = time.perf_counter()
            cpu, _ = _greedy(base.replace(backend="cpu", dtype=dtype), args.max_tokens)
            acc, kernel = _greedy(base.replace(backend=args.backend, dtype=dtype), args.max_tokens)
            first_diff = [
                next(
                    (i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b),
                    None if len(x) == len(y) else min(len(x), len(y)),
                )
                for x, y in zip(cpu, acc, strict=True)
            ]
            same = all(d is None for d in first_diff)
            print(
                json.dumps(
                    {
                        "check": "greedy_vs_cpu",
                        "model": name,
                        "dtype": dtype,
                        "backend": args.backend,
                        "attention": kernel,
                        "identical": same,
                        "first_diff_per_prompt": first_diff,
                        "tokens": [len(x) for x in acc],
                        "seconds": round(time.perf_counter() - t0, 1),
                    }
                ),
                flush=True,
            )
            ok &= same or name != "succ"
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
