"""The roofline line every benchmark prints: this machine's ceilings, measured in the same run.

Owns: measuring fp32 GEMM FLOP/s (numpy matmul, 2048², best of a few) and memory read
bandwidth (a BLAS dot of a large float32 array with itself, split across all cores, each
thread its own slice, best of a few; a dot streams at the memory's rate where np.sum's
pairwise summation was ~15% slower per core; on a shared machine any other busy process
lowers this ceiling too, so compare fractions from one run); counting a
Llama-family model's parameters from its config.json; and the achieved fractions

    FLOP fraction = FLOPs/token × tokens/s ÷ GEMM FLOP/s
    BW fraction   = weight bytes × steps/s ÷ read bandwidth

What is counted (a GGUF file: `gguf_model_cost`): parameters are every stored tensor of a Llama/Qwen2/Mistral config
(embedding, per-layer q/k/v/o, gate/up/down, both norms, q/k/v biases when present, the
final norm, and lm_head only when not tied). FLOPs/token = 2 × matmul parameters, where
the matmul parameters are the per-layer linears plus the lm_head product (V×D, done even
when tied); the embedding lookup is a gather and norms are ignored, attention's QKᵀ and AV
(which grow with context) are not counted. For a tied model this equals 2 × parameter
count minus the norms. Steps/s is exact only for single-stream decode (= tokens/s); callers
say how they estimate it elsewhere.

Imports numpy and the stdlib only (reads config.json itself, so a peer's model dir works
without tl; a GGUF file's counts through gguf-py, when asked for); `measure_device_machine`, for
runs on a GPU or TPU, imports jax when called: there the ceilings are the accelerator's (a
matmul in the step's dtype, and a sum streaming a large float32 array from device memory), not
the host's. Used by bench/http_bench.py, bench/runner_bench.py, bench/engine_bench.py.
Tested by tests/bench/test_bench_harness.py.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class Machine:
    gemm_flops_per_s: float  # fp32 numpy matmul, n×n, best of `repeat`
    mem_read_bytes_per_s: float  # x·x of a float32 array split across `threads` threads, best of `repeat`
    gemm_n: int
    mem_bytes: int
    threads: int
    repeat: int
    where: str = "numpy"  # what measured it: "numpy" (host), or "jax <platform> <dtype>" (accelerator)
    gemm_dtype: str = "fp32"


@dataclass(frozen=True, slots=True)
class ModelCost:
    num_params: int  # every stored tensor (tied embeddings counted once)
    num_matmul_params: int  # per-layer linears + lm_head product (V×D, even when tied)
    weight_bytes: int  # what a decode step reads: num_params × bytes_per_param (a GGUF: its stored bytes)
    bytes_per_param: float

    @property
    def flops_per_token(self) -> int:
        return 2 * self.num_matmul_params


def measure_gemm(n: int = 2048, repeat: int = 5) -> float:
    """fp32 FLOP/s of one n×n matmul (numpy's BLAS, all its threads), best of `repeat`."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b  # warm the BLAS thread pool
    best = min(_seconds(lambda: a @ b) for _ in range(repeat))
    return 2 * n**3 / best


def measure_mem_read(num_bytes: int = 256 << 20, threads: int | None = None, repeat: int = 5) -> float:
    """Read bandwidth in bytes/s: each thread dots its slice with itself (BLAS, GIL released)."""
    threads = threads or os.cpu_count() or 1
    x = np.ones(num_bytes // 4, dtype=np.float32)
    parts = np.array_split(x, threads)

    def read(part: np.ndarray) -> float:
        return float(np.dot(part, part))

    with ThreadPoolExecutor(threads) as pool:

        def read_all() -> None:
            list(pool.map(read, parts))

        read_all()
        best = min(_seconds(read_all) for _ in range(repeat))
    return x.nbytes / best


def measure_device_machine(dtype: str, gemm_n: int = 8192, mem_bytes: int = 1 << 30, repeat: int = 7) -> Machine:
    """The two ceilings on JAX's default accelerator: an n×n matmul in `dtype` ("bfloat16" or
    "float32", at JAX's default precision, which on NVIDIA GPUs is TF32 for float32) and the
    read bandwidth of a sum over a float32 array in device memory; best of `repeat`, timed to
    block_until_ready."""
    import jax
    import jax.numpy as jnp

    kx, ky = jax.random.split(jax.random.key(0))
    a = jax.random.normal(kx, (gemm_n, gemm_n), dtype=dtype)
    b = jax.random.normal(ky, (gemm_n, gemm_n), dtype=dtype)
    x = jnp.ones(mem_bytes // 4, dtype=jnp.float32)
    mm, total = jax.jit(jnp.matmul), jax.jit(jnp.sum)
    mm(a, b).block_until_ready()
    total(x).block_until_ready()
    gemm = min(_seconds(lambda: mm(a, b).block_until_ready()) for _ in range(repeat))
    read = min(_seconds(lambda: total(x).block_until_ready()) for _ in range(repeat))
    platform = jax.default_backend()
    return Machine(
        2 * gemm_n**3 / gemm,
        x.nbytes / read,
        gemm_n,
        int(x.nbytes),
        1,
        repeat,
        where=f"jax {platform}",
        gemm_dtype="bf16" if dtype == "bfloat16" else "fp32",
    )


def measure_machine(gemm_n: int = 2048, mem_bytes: int = 256 << 20, repeat: int = 7) -> Machine:
    threads = os.cpu_count() or 1
    return Machine(
        measure_gemm(gemm_n, repeat), measure_mem_read(mem_bytes, threads, repeat), gemm_n, mem_bytes, threads, repeat
    )


def _seconds(fn: object) -> float:
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t0


def model_cost(config: dict[str, Any], bytes_per_param: float = 4) -> ModelCost:
    """Parameter and FLOP counts of a Llama-family config.json dict (see the module docstring)."""
    d, v, f = int(config["hidden_size"]), int(config["vocab_size"]), int(config["intermediate_size"])
    layers, heads = int(config["num_hidden_layers"]), int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or d // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    arch = (config.get("architectures") or [""])[0]
    bias = bool(config.get("attention_bias", arch == "Qwen2ForCausalLM"))
    linears = d * (q + 2 * kv) + q * d + 3 * d * f
    per_layer = linears + 2 * d + ((q + 2 * kv) if bias else 0)
    tied = bool(config.get("tie_word_embeddings", False))
    num_params = v * d + layers * per_layer + d + (0 if tied else v * d)
    return ModelCost(num_params, layers * linears + v * d, int(num_params * bytes_per_param), bytes_per_param)


def load_model_cost(model_dir: str | Path, bytes_per_param: float = 4) -> ModelCost:
    """From a Hugging Face directory's config.json at `bytes_per_param`, or from a GGUF file's
    tensors as stored (`gguf_model_cost`)."""
    if str(model_dir).endswith(".gguf"):
        return gguf_model_cost(model_dir)
    return model_cost(json.loads((Path(model_dir) / "config.json").read_text()), bytes_per_param)


def gguf_model_cost(path: str | Path) -> ModelCost:
    """A GGUF's counts from its tensors (gguf-py's reader): every tensor's elements; the matmul
    parameters every 2-D weight's but the embedding's, plus the embedding's where no output.weight
    (tied: the LM head reads it); the bytes a token reads the same tensors' stored bytes and the
    1-D ones (a lookup reads one embedding row, not counted)."""
    from gguf import GGUFReader

    try:
        tensors = GGUFReader(str(path)).tensors
    except (IndexError, ValueError, OSError) as e:  # gguf-py's reader on a damaged or foreign file
        raise ValueError(f"{path}: not a readable GGUF ({e})") from None
    tied = not any(t.name == "output.weight" for t in tensors)
    read = [t for t in tensors if t.name != "token_embd.weight" or tied]
    params = sum(int(t.n_elements) for t in tensors)
    matmul = sum(int(t.n_elements) for t in read if len(t.shape) == 2)
    stored = sum(int(t.n_bytes) for t in read)
    return ModelCost(params, matmul, stored, sum(int(t.n_bytes) for t in tensors) / params)


def fractions(machine: Machine, cost: ModelCost, tokens_per_s: float, steps_per_s: float) -> dict[str, float]:
    """Achieved fraction of the GEMM and memory-read ceilings (0.25 = 25 %)."""
    return {
        "flop_frac": cost.flops_per_token * tokens_per_s / machine.gemm_flops_per_s,
        "bw_frac": cost.weight_bytes * steps_per_s / machine.mem_read_bytes_per_s,
    }


def roofline_line(machine: Machine, cost: ModelCost | None, model: str = "") -> str:
    """One line: the ceilings, the model's cost, and the decode limits they imply."""
    how = (
        f"{machine.mem_bytes >> 20} MiB float32 x·x over {machine.threads} threads"
        if machine.where == "numpy"
        else f"{machine.mem_bytes >> 20} MiB float32 sum"
    )
    s = (
        f"roofline: {machine.gemm_dtype} GEMM {machine.gemm_flops_per_s / 1e9:.1f} GFLOP/s ({machine.where} "
        f"{machine.gemm_n}², best of {machine.repeat}); memory read {machine.mem_read_bytes_per_s / 1e9:.1f} GB/s "
        f"({how}, best of {machine.repeat})"
    )
    if cost is None:
        return s
    mem_tok_s = machine.mem_read_bytes_per_s / cost.weight_bytes
    flop_tok_s = machine.gemm_flops_per_s / cost.flops_per_token
    return (
        s + f"; model {model}: {cost.num_params / 1e6:.1f} M params, {cost.weight_bytes / 1e6:.1f} MB weights "
        f"at {cost.bytes_per_param:.3g} B/param, {cost.flops_per_token / 1e6:.1f} MFLOP/token (2 × matmul params, "
        f"attention excluded) -> ceilings: batch-1 decode {mem_tok_s:.0f} tok/s (memory), "
        f"{flop_tok_s:.0f} tok/s (compute)"
    )


def roofline_rows(machine: Machine, cost: ModelCost, items: list[tuple[str, float, float]]) -> list[dict[str, object]]:
    """Rows of (label, tokens/s, steps/s) with their fractions, as percentages for a table."""
    rows: list[dict[str, object]] = []
    for label, tok_s, steps_s in items:
        fr = fractions(machine, cost, tok_s, steps_s)
        rows.append(
            {
                "test": label,
                "tokens/s": round(tok_s, 1),
                "steps/s": round(steps_s, 2),
                "% GEMM": round(100 * fr["flop_frac"], 1),
                "% mem BW": round(100 * fr["bw_frac"], 1),
            }
        )
    return rows


def print_offline_roofline(
    model_dir: str,
    items: list[tuple[str, float, float]],
    bytes_per_param: float = 4,
    platform: str = "cpu",
    dtype: str = "float32",
) -> None:
    """What runner_bench and engine_bench print at their end: the line and a fractions table,
    against the host's ceilings, or the accelerator's when `platform` is not "cpu"."""
    from bench.report import print_table

    machine = measure_machine() if platform == "cpu" else measure_device_machine(dtype)
    try:
        cost: ModelCost | None = load_model_cost(model_dir, bytes_per_param)
    except (OSError, KeyError, ValueError):
        cost = None
    print(roofline_line(machine, cost, model_dir))
    if cost is not None and items:
        print_table(roofline_rows(machine, cost, items))


def machine_dict(machine: Machine) -> dict[str, object]:
    return asdict(machine)
