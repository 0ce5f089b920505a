"""`python -m bench synth`: a random-weight GGUF of a real model's shape, in a served format.

    python -m bench synth --shape llama3.2-1b --format q4_k_m --out /tmp/llama1b.gguf [--seed 0]
        [--layers N] [--threads N] [--llama-quantize [PATH]]
    python -m bench synth --list

Owns: the weights' values (`source`: per tensor and per chunk of rows, a normal draw of std
WEIGHT_STD, through a table of its quantiles, seeded by (seed, the tensor's name, the chunk): a
file is fixed by shape, format, seed and layers, and a tensor's values do not depend on how many
layers the file has; norms ones; Llama 3's rope_freqs its divisors), `synthesize` (the file,
streamed: each tensor made and written in chunks of rows by a thread pool, in order, so memory
stays a few chunks per thread), the llama-quantize route (`--llama-quantize`: an F16 file
quantized by llama.cpp's own tool, for when its bytes rather than these quantizers' are wanted;
never required) and the CLI.
The output is noise; the shapes, types and byte counts are a real model's (bench/synth_shapes.py,
bench/synth_mix.py), which is what timing needs. Both tl (`TL_ENGINE__MODEL_DIR=<file>`) and
llama.cpp load the file: llama.cpp's names, keys and per-tensor types, the tokenizer copied from
the shipped GGUF the shape names.
Must not hold a whole tensor of a large model in memory. Tested by tests/bench/test_synth.py.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import subprocess
import sys
import time
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from bench.kquants import quantize_rows
from bench.synth_gguf import TensorInfo, pad, write_head
from bench.synth_layout import TensorSpec, metadata, tensor_specs
from bench.synth_mix import MIXES, Mix, Q, tensor_bytes, tensor_type
from bench.synth_shapes import SHAPES, TOKENIZERS, Shape
from tl.model.gguf_file import GGUFFile
from tl.model.gguf_model import llama3_rope_factors

WEIGHT_STD = 0.02  # keeps activations finite through every layer (norms renormalize each one)
CHUNK_VALUES = 1 << 19  # values a job makes: ~2 MB of float32, cache-sized for the quantizers


@dataclass(frozen=True, slots=True)
class Planned:
    """A file's tensors with the type each is stored in."""

    shape: Shape
    mix: Mix
    num_layers: int
    specs: tuple[TensorSpec, ...]
    types: tuple[Q, ...]

    @property
    def num_params(self) -> int:
        return sum(s.num_values for s in self.specs)

    @property
    def tensor_bytes(self) -> int:
        return sum(tensor_bytes(s, t) for s, t in zip(self.specs, self.types, strict=True))


def plan(shape: Shape, mix: Mix, num_layers: int | None = None) -> Planned:
    n = shape.num_layers if num_layers is None else num_layers
    specs = tensor_specs(shape, n)
    tied = all(s.kind != "output" for s in specs)
    return Planned(shape, mix, n, specs, tuple(tensor_type(mix, s, n, tied) for s in specs))


def chunk_rows(spec: TensorSpec) -> int:
    """Rows of a chunk: fixed by the row length, so the values never depend on threads."""
    return max(1, CHUNK_VALUES // spec.shape[-1])


def _rows(spec: TensorSpec) -> int:
    return spec.num_values // spec.shape[-1]


def source_chunk(seed: int, spec: TensorSpec, chunk: int, shape: Shape) -> np.ndarray:
    """float32 [rows, row length]: chunk `chunk` of the tensor's rows (see the module docstring)."""
    step = chunk_rows(spec)
    rows, cols = min(step, _rows(spec) - chunk * step), spec.shape[-1]
    if spec.fill == "ones":
        return np.ones((rows, cols), np.float32)
    if spec.fill == "rope_freqs":
        assert shape.rope_scaling is not None
        return llama3_rope_factors(shape.rope_scaling.to_dict(), shape.rope_theta, shape.head_dim).reshape(1, -1)
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode()), chunk])
    return np.take(_normal_levels(), rng.integers(0, 1 << 16, (rows, cols), dtype=np.uint16))


@functools.cache
def _normal_levels() -> np.ndarray:
    """float32 [65536]: the quantiles of N(0, WEIGHT_STD^2) at (i + 1/2) / 65536. A uniform 16-bit
    draw looked up here is a normal draw to 1/65536 of probability, three to four times as fast
    as numpy's ziggurat, which was half of a file's time."""
    dist = statistics.NormalDist(0.0, WEIGHT_STD)
    return np.array([dist.inv_cdf((i + 0.5) / 65536) for i in range(65536)], np.float32)


def source(seed: int, spec: TensorSpec, shape: Shape) -> np.ndarray:
    """The whole tensor's float32 values, numpy order (what its stored bytes quantize)."""
    n = -(-_rows(spec) // chunk_rows(spec))
    return np.concatenate([source_chunk(seed, spec, i, shape) for i in range(n)]).reshape(spec.shape)


def _jobs(p: Planned) -> Iterator[tuple[TensorSpec, Q, int, bool]]:
    for spec, t in zip(p.specs, p.types, strict=True):
        n = -(-_rows(spec) // chunk_rows(spec))
        for i in range(n):
            yield spec, t, i, i == n - 1


def synthesize(out: Path, p: Planned, seed: int, threads: int, tokenizer: Path | None = None) -> int:
    """Write the planned file to `out` (through `out`.part, renamed when complete); its bytes."""
    tok = TOKENIZERS[p.shape.tokenizer]
    try:
        shipped = GGUFFile(tokenizer or tok.path)
    except ValueError as e:
        raise ValueError(f"{tokenizer or tok.path}: {e}") from None
    raw = {k: shipped.entry_bytes(k) for k in shipped.fields if k.startswith("tokenizer.")}
    if len(shipped.field("tokenizer.ggml.tokens", [])) != p.shape.vocab_size:
        raise ValueError(f"{tokenizer or tok.path}: its vocabulary is not {tok.name}'s {p.shape.vocab_size} tokens")
    fields = {"general.architecture": p.shape.arch, **metadata(p.shape, p.num_layers, p.mix.file_type)}
    infos = [TensorInfo(s.name, s.shape, t, tensor_bytes(s, t)) for s, t in zip(p.specs, p.types, strict=True)]
    part = out.with_name(out.name + ".part")
    try:
        with part.open("wb") as f, ThreadPoolExecutor(threads) as pool:
            write_head(f, fields, raw, infos)
            pending: deque[tuple[Future[np.ndarray], bool]] = deque()
            for spec, t, i, last in _jobs(p):
                pending.append((pool.submit(_encode, seed, spec, t, i, p.shape), last))
                if len(pending) > 2 * threads:
                    _drain(f, pending.popleft())
            while pending:
                _drain(f, pending.popleft())
    except BaseException:  # a full disk, an interrupt: no partial file left behind
        part.unlink(missing_ok=True)
        raise
    part.replace(out)
    return out.stat().st_size


def _encode(seed: int, spec: TensorSpec, t: Q, chunk: int, shape: Shape) -> np.ndarray:
    return quantize_rows(source_chunk(seed, spec, chunk, shape), t)


def _drain(f: BinaryIO, job: tuple[Future[np.ndarray], bool]) -> None:
    data, last = job
    f.write(np.ascontiguousarray(data.result()).data)
    if last:
        pad(f)


def llama_quantize(exe: str, out: Path, p: Planned, seed: int, threads: int, tokenizer: Path | None) -> int:
    """The same weights written F16, then `exe` (llama.cpp's llama-quantize) makes p.mix from them."""
    f16 = out.with_name(out.name + ".f16.part")
    synthesize(f16, plan(p.shape, MIXES["f16"], p.num_layers), seed, threads, tokenizer)
    try:
        subprocess.run([exe, str(f16), str(out), p.mix.llama_quantize, str(threads)], check=True)
    finally:
        f16.unlink(missing_ok=True)
    return out.stat().st_size


def list_shapes() -> None:
    from bench.report import print_table

    rows = []
    for s in SHAPES.values():
        row: dict[str, object] = {"shape": s.name, "arch": s.arch, "layers": s.num_layers}
        row["params (B)"] = f"{plan(s, MIXES['f16']).num_params / 1e9:.2f}"
        row["vocab (published)"] = f"{s.vocab_size} ({s.published_vocab_size})"
        row |= {f"{m} GB": f"{plan(s, MIXES[m]).tensor_bytes / 1e9:.2f}" for m in MIXES}
        rows.append(row)
    print_table(rows)
    print("GB: tensor data (1e9 bytes); the tokenizer adds 1.8 MB (SmolLM2's) or 6.5 MB (Gemma 3's)")


def run(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench synth", description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print the shapes, their parameters and sizes, and exit")
    ap.add_argument("--shape", choices=list(SHAPES))
    ap.add_argument("--format", choices=list(MIXES))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="fewer blocks than the shape's (quick tests)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--tokenizer", type=Path, default=None, help="the GGUF to copy the tokenizer from")
    ap.add_argument(
        "--llama-quantize", nargs="?", const="llama-quantize", default=None, metavar="PATH",
        help="write F16, then quantize with llama.cpp's llama-quantize (on PATH, or at PATH)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.list:
        list_shapes()
        return 0
    if args.shape is None or args.format is None or args.out is None:
        ap.error("--shape, --format and --out are required (or --list)")
    p = plan(SHAPES[args.shape], MIXES[args.format], args.layers)
    if not 0 < p.num_layers <= p.shape.num_layers:
        ap.error(f"--layers {args.layers}: {args.shape} has 1 to {p.shape.num_layers}")
    if not args.out.parent.is_dir():
        ap.error(f"--out {args.out}: the directory {args.out.parent} does not exist")
    if args.threads < 1:
        ap.error(f"--threads {args.threads}: at least 1")
    tok = args.tokenizer or TOKENIZERS[p.shape.tokenizer].path
    if not tok.is_file():
        ap.error(f"{tok} is missing: `tl pull {TOKENIZERS[p.shape.tokenizer].pull}` fetches it")
    exe = shutil.which(args.llama_quantize) if args.llama_quantize else None
    if args.llama_quantize and (exe is None or args.format == "f16"):
        ap.error(f"--llama-quantize: {args.llama_quantize!r} is not an executable, or --format is f16")
    print(
        f"synth: shape {p.shape.name} ({p.shape.source}) format {p.mix.name} layers {p.num_layers} seed {args.seed} "
        f"threads {args.threads} params {p.num_params / 1e9:.3f}B vocab {p.shape.vocab_size} "
        f"quantizer {exe or 'bench/kquants.py + gguf-py'} -> {args.out}"
    )
    t0 = time.perf_counter()
    try:
        if exe:
            size = llama_quantize(exe, args.out, p, args.seed, args.threads, args.tokenizer)
        else:
            size = synthesize(args.out, p, args.seed, args.threads, args.tokenizer)
    except (OSError, ValueError, subprocess.CalledProcessError) as e:  # unwritable --out, a --tokenizer
        # that is no GGUF or not the shape's, llama-quantize failing
        print(f"python -m bench synth: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {size / 1e9:.3f} GB in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
