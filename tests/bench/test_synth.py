"""`python -m bench synth` (bench/synth*.py, bench/kquants.py): random-weight GGUFs of real shapes.

Files of a few layers (and, where a full layer would be slow, narrower matrices: `_small`) are
written into tmp_path and read back with gguf-py's GGUFReader (the independent reader; once, as
it takes seconds over a tokenizer) or tl's GGUFFile (tested against it); the checks:
- tensor names, types and shapes, and the metadata, are what the shape's record and llama.cpp's
  layout say, the tokenizer the shipped file's;
- every stored tensor, dequantized by gguf.quants.dequantize, is the seeded source within one
  step of its block's grid (half a step for the formats that round to nearest);
- the K-quant mixes' per-tensor types follow llama.cpp's rule, which reproduces the types of the
  shipped Q4_K_M Gemma 3 270M and Q4_1 SmolLM2 files tensor for tensor;
- the same (shape, format, seed, layers) gives the same bytes whatever the threads; another seed
  other bytes;
- tl serves the file: its engine generates greedy tokens, and tl reads the config the record has;
- `--list` prints every shape with its parameters and sizes; `--llama-quantize` runs the tool on
  an F16 file (a stand-in script here: llama.cpp is not built on this machine).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import stat
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from bench import synth
from bench.kquants import quantize_rows
from bench.synth import Planned
from bench.synth_layout import TensorSpec
from bench.synth_mix import MIXES, tensor_type, use_more_bits
from bench.synth_shapes import SHAPES, TOKENIZERS, Shape
from tl.model.config import hf_shapes
from tl.model.gguf_file import GGUFFile
from tl.model.gguf_model import gguf_model_config, open_gguf, packed_tensors

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module", autouse=True)
def shipped(smol_dir: Path, gemma_dir: Path) -> None:
    """The tokenizers' GGUFs are where the shape records look for them."""
    assert all(t.path.is_file() for t in TOKENIZERS.values())


def _small(name: str, hidden: int = 256, heads: int = 4, kv: int = 2, head_dim: int = 64, ff: int = 512) -> Shape:
    """The named shape with narrower matrices (its architecture, features and tokenizer kept)."""
    s = SHAPES[name]
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": ff} if s.num_experts else {}
    return dataclasses.replace(
        s, hidden_size=hidden, num_heads=heads, num_kv_heads=kv, head_dim=head_dim, intermediate_size=ff, **moe
    )


def _write(
    tmp_path: Path, shape: Shape, fmt: str, layers: int, seed: int = 0, threads: int = 2
) -> tuple[Path, Planned]:
    p = synth.plan(shape, MIXES[fmt], layers)
    out = tmp_path / f"{shape.name}-{fmt}-{layers}-{seed}-{threads}.gguf"
    synth.synthesize(out, p, seed, threads)
    return out, p


# One step of each block's grid, from the source values alone: a K-quant's super-block range over
# its levels (its sub-blocks' steps are at most ~3% coarser), the 32-value formats' as gguf-py
# quantizes them. Q4_0 / Q5_0 put the largest magnitude at -8 / -16 and may clip the other side by
# a step; the rest round to nearest.
def _step(x: np.ndarray, t: Q) -> np.ndarray:
    if t in (Q.F32, Q.F16):
        return np.abs(x) * 2.0**-10 + 2.0**-24
    b = x.reshape(-1, gguf.GGML_QUANT_SIZES[t][0])
    amax, hi, lo = np.abs(b).max(-1), np.maximum(b.max(-1), 0), np.minimum(b.min(-1), 0)
    per_block = {
        Q.Q8_0: amax / 127, Q.Q4_0: amax / 8, Q.Q5_0: amax / 16,
        Q.Q4_1: (b.max(-1) - b.min(-1)) / 15, Q.Q5_1: (b.max(-1) - b.min(-1)) / 31,
        Q.Q4_K: (hi - lo) / 15, Q.Q5_K: (hi - lo) / 31, Q.Q6_K: amax / 31,
    }[t]  # fmt: skip
    return np.repeat(per_block, b.shape[1]).reshape(x.shape)


def _check_values(path: Path, p: Planned, seed: int) -> set[Q]:
    """Each tensor has its planned type and shape, and its first and last chunk of rows (every
    row of most) dequantized are the source within a step; the types seen."""
    tensors = {t.name: t for t in GGUFFile(path).tensors}
    assert list(tensors) == [s.name for s in p.specs]
    for spec, t in zip(p.specs, p.types, strict=True):
        stored = tensors[spec.name]
        assert Q(stored.tensor_type) == t and tuple(reversed(stored.shape)) == spec.shape, spec.name
        rows = stored.data.reshape(-1, stored.data.shape[-1])
        step, n = synth.chunk_rows(spec), -(-len(rows) // synth.chunk_rows(spec))
        for i in {0, n - 1}:
            x = synth.source_chunk(seed, spec, i, p.shape)
            got = np.asarray(gguf.quants.dequantize(rows[i * step : i * step + len(x)], t), np.float32)
            limit = (1.01 if t in (Q.Q4_0, Q.Q5_0) else 0.6 if t not in (Q.F32, Q.F16) else 1.0) * _step(x, t)
            err = np.abs(got.reshape(x.shape) - x)
            assert (err <= limit).all(), (spec.name, t.name, float((err / limit).max()))
            assert t == Q.F32 or err.max() > 0  # the values did go through the format
    return set(p.types)


CASES = {  # (shape, format, layers): every architecture and every format, K-mix fallbacks included
    "llama-8b-q4_k_m": (lambda: _small("llama3.1-8b"), "q4_k_m", 3),
    "qwen3moe-q5_k_m": (lambda: _small("qwen3-30b-a3b"), "q5_k_m", 2),
    "gemma3-1b-q6_k": (lambda: _small("gemma3-1b", hidden=128, heads=2, kv=1, head_dim=128), "q6_k", 2),
    "qwen3-q4_0": (lambda: _small("qwen3-1.7b"), "q4_0", 1),
    "llama-1b-q4_1": (lambda: _small("llama3.2-1b", head_dim=32, heads=8), "q4_1", 1),
    "qwen3-q8_0": (lambda: _small("qwen3-4b"), "q8_0", 1),
    "gemma3-4b-f16": (lambda: _small("gemma3-4b", hidden=128, heads=2, kv=2, head_dim=64), "f16", 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_stored_values_are_the_source_within_a_step(tmp_path: Path, case: str) -> None:
    make, fmt, layers = CASES[case]
    path, p = _write(tmp_path, make(), fmt, layers)
    seen = _check_values(path, p, seed=0)
    assert MIXES[fmt].default in seen and (fmt != "q6_k" or Q.Q8_0 in seen)  # Gemma 128 wide: Q6_K's fallback
    cfg = gguf_model_config(open_gguf(path), path)  # tl reads the record back, and finds every tensor it needs
    s = p.shape
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (s.hidden_size, layers, s.vocab_size)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (s.num_heads, s.num_kv_heads, s.head_dim)
    assert (cfg.intermediate_size, cfg.tie_word_embeddings) == (s.intermediate_size, s.tie_word_embeddings)
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.sliding_window) == (s.rope_theta, s.rope_scaling, s.sliding_window)
    assert (cfg.num_experts, cfg.moe_intermediate_size) == (s.num_experts, s.moe_intermediate_size)
    assert len(packed_tensors(path)) == len(hf_shapes(cfg))


def test_the_file_is_the_record_as_gguf_py_reads_it(tmp_path: Path) -> None:
    shape = _small("qwen3-30b-a3b")
    path, p = _write(tmp_path, shape, "q4_k_m", 2)
    r = gguf.GGUFReader(str(path))
    assert [(t.name, t.tensor_type, tuple(int(n) for n in reversed(t.shape))) for t in r.tensors] == [
        (s.name, t, s.shape) for s, t in zip(p.specs, p.types, strict=True)
    ]
    f = {k: v.contents() for k, v in r.fields.items()}
    a = "qwen3moe."
    assert f["general.architecture"] == "qwen3moe" and f["general.file_type"] == 15
    assert (f[a + "block_count"], f[a + "embedding_length"], f[a + "feed_forward_length"]) == (2, 256, 512)
    assert (f[a + "attention.head_count"], f[a + "attention.head_count_kv"]) == (4, 2)
    assert (f[a + "attention.key_length"], f[a + "attention.value_length"]) == (64, 64)
    assert (f[a + "expert_count"], f[a + "expert_used_count"], f[a + "expert_feed_forward_length"]) == (4, 2, 512)
    assert (f[a + "context_length"], f[a + "rope.freq_base"]) == (40960, 1e6)
    assert f[a + "attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6, rel=1e-7)
    shipped = GGUFFile(TOKENIZERS["smollm2"].path).fields
    tok_keys = [k for k in shipped if k.startswith("tokenizer.")]
    assert len(tok_keys) >= 10 and [k for k in f if k.startswith("tokenizer.")] == tok_keys
    assert all(f[k] == shipped[k] for k in tok_keys)
    assert len(f["tokenizer.ggml.tokens"]) == 49152 and "tokenizer.ggml.merges" in f


def test_the_mixes_follow_llama_cpp_and_reproduce_the_shipped_files() -> None:
    # use_more_bits over 16 layers: the first two, the last two, every third between
    assert [i for i in range(16) if use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]
    p = synth.plan(SHAPES["llama3.1-8b"], MIXES["q4_k_m"])
    types = {s.name: t for s, t in zip(p.specs, p.types, strict=True)}
    for i in range(32):
        more = Q.Q6_K if use_more_bits(i, 32) else Q.Q4_K
        assert types[f"blk.{i}.attn_v.weight"] == types[f"blk.{i}.ffn_down.weight"] == more
        assert types[f"blk.{i}.attn_q.weight"] == types[f"blk.{i}.ffn_up.weight"] == Q.Q4_K
    assert types["output.weight"] == Q.Q6_K and types["token_embd.weight"] == Q.Q4_K
    assert synth.plan(SHAPES["llama3.2-1b"], MIXES["q4_k_m"]).types[0] == Q.Q6_K  # tied: the output's type
    assert synth.plan(SHAPES["gemma3-1b"], MIXES["q4_k_m"]).types[0] == Q.Q8_0  # 1152 wide: no K-quant rows
    assert set(synth.plan(SHAPES["qwen3-8b"], MIXES["q6_k"]).types) == {Q.Q6_K, Q.F32}
    for name, fmt in (("gemma3-270m", "q4_k_m"), ("smol-135m", "q4_1")):  # llama-quantize's own files
        real = GGUFFile(TOKENIZERS["gemma3" if "gemma" in name else "smollm2"].path)
        arch = real.field("general.architecture")
        n, tied = real.field(f"{arch}.block_count"), all(t.name != "output.weight" for t in real.tensors)
        for t in real.tensors:
            m = re.match(r"blk\.(\d+)\.", t.name)
            spec = TensorSpec(t.name, tuple(reversed(t.shape)), "normal", int(m.group(1)) if m else -1)
            assert tensor_type(MIXES[fmt], spec, n, tied) == t.tensor_type, (name, t.name)
        assert len({t.tensor_type for t in real.tensors}) >= 3


def test_same_seed_same_bytes_whatever_the_threads(tmp_path: Path) -> None:
    shape = _small("llama3.2-3b")
    a, _ = _write(tmp_path, shape, "q5_k_m", 1, seed=7, threads=1)
    b, _ = _write(tmp_path, shape, "q5_k_m", 1, seed=7, threads=2)
    c, _ = _write(tmp_path, shape, "q5_k_m", 1, seed=8, threads=2)

    def digest(p: Path) -> str:
        return hashlib.sha256(p.read_bytes()).hexdigest()

    assert digest(a) == digest(b) != digest(c)


def test_quantizers_keep_every_value_within_half_a_step() -> None:
    """bench/kquants.py's K-quants on awkward blocks: all zero, one sign, an outlier, tiny values."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 512), dtype=np.float32) * 0.02
    x[0] = 0
    x[1] = np.abs(x[1])
    x[2] = -np.abs(x[2])
    x[3, 5] = 3.0
    x[4] *= 1e-4  # subnormal f16 scales
    for t in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        got = gguf.quants.dequantize(quantize_rows(x, t), t).reshape(x.shape)
        assert np.isfinite(got).all() and (np.abs(got - x) <= 0.6 * _step(x, t) + 1e-12).all(), t.name
        assert (got[0] == 0).all()


def test_tl_engine_generates_from_a_file(tmp_path: Path) -> None:
    """tl's engine generates greedy tokens from a Llama 3.2 file in Q4_K_M (the other files are
    read by tl above: config and every tensor)."""
    from tests.helpers.runner import ENGINE
    from tl.core.engine import Engine
    from tl.core.request import GenRequest, SamplingParams
    from tl.runtime.runner import ModelRunner

    shape = _small("llama3.2-1b")
    path, _ = _write(tmp_path, shape, "q4_k_m", 2)
    engine_cfg = ENGINE.replace(model_dir=str(path), matmul_kernel="xla")
    engine = Engine(ModelRunner.from_model_dir(engine_cfg), engine_cfg)
    engine.add_request(GenRequest((2, 17, 400, 9), SamplingParams(temperature=0.0, max_tokens=4)))
    tokens = []
    while engine.has_work():
        tokens += [o.token_id for o in engine.step() if o.token_id >= 0]
    assert len(tokens) == 4 and all(0 <= t < shape.vocab_size for t in tokens)


def test_list_prints_every_shape_with_its_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert synth.run(["--list"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert set(SHAPES) <= set(rows)
    s = SHAPES["llama3.1-8b"]  # counted by hand: embedding and output, 32 layers, final norm, rope_freqs
    v, h, f, kv = 49152, 4096, 14336, 8 * 128
    layer = h * (2 * h + 2 * kv) + 3 * h * f + 2 * h
    assert synth.plan(s, MIXES["f16"]).num_params == 2 * v * h + 32 * layer + h + 64
    cells = [c.strip() for c in rows["llama3.1-8b"].split("|")[1:-1]]
    assert cells[3] == "7.38" and cells[-3] == "4.46"  # params (B); Q4_K_M GB (4.9 with the published vocab)
    assert float(rows["qwen3-30b-a3b"].split("|")[-4]) < 24 * 2**30 / 1e9  # fits a 24 GiB machine


def test_llama_quantize_is_run_on_an_f16_file(tmp_path: Path) -> None:
    """A stand-in for llama.cpp's tool records its arguments and copies its input."""
    tool = tmp_path / "llama-quantize"
    tool.write_text(
        f"#!{sys.executable}\nimport shutil, sys\n"
        f"open({str(tmp_path / 'args')!r}, 'w').write(' '.join(sys.argv[3:]))\n"
        "shutil.copy(sys.argv[1], sys.argv[2])\n"
    )
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "q.gguf"
    synth.llama_quantize(str(tool), out, synth.plan(_small("qwen3-0.6b"), MIXES["q4_k_m"], 1), 0, 2, None)
    assert (tmp_path / "args").read_text() == "Q4_K_M 2"  # llama-quantize's type and threads
    written = GGUFFile(out)  # the stand-in's copy of its input: the same weights in F16
    assert written.field("general.file_type") == 1 and Q(written.tensors[0].tensor_type) == Q.F16  # token_embd
    assert not list(tmp_path.glob("*.part"))


def test_bad_arguments_and_files_are_one_clear_line_and_leave_no_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--shape", "qwen3-0.6b", "--format", "q4_0", "--layers", "1"]
    with pytest.raises(SystemExit):  # argparse's usage error, exit 2
        synth.run([*base, "--out", str(tmp_path / "no-such-dir" / "x.gguf")])
    assert "no-such-dir does not exist" in capsys.readouterr().err
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf")
    cases = {
        str(tmp_path / "bad.gguf"): "bad.gguf: bad magic (not a GGUF file)",
        str(TOKENIZERS["gemma3"].path): "its vocabulary is not smollm2's 49152 tokens",
    }
    for tokenizer, message in cases.items():
        assert synth.run([*base, "--out", str(tmp_path / "x.gguf"), "--tokenizer", tokenizer]) == 2
        assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [tmp_path / "bad.gguf"]  # no file and no .part left


def test_a_write_that_fails_midway_leaves_no_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(*_: object) -> np.ndarray:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(synth, "_encode", full_disk)
    out = tmp_path / "x.gguf"
    assert synth.run(["--shape", "qwen3-0.6b", "--format", "q4_0", "--layers", "1", "--out", str(out)]) == 2
    assert list(tmp_path.iterdir()) == []
