"""tl.model.files and the builders of tests/helpers/models.py: safetensors reading (single,
sharded, f16/bf16), errors that name the file, shape checks, side files, and the
succ/tiny model dirs themselves."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.models import (
    BYTE_VOCAB_SIZE,
    ENDOFTEXT_ID,
    IM_END_ID,
    SUCC_MARGIN,
    make_succ,
    make_tiny_llama,
    succ_config,
    succ_logits,
    succ_tensors,
)
from tl.model.config import ModelDirError, load_model_config
from tl.model.files import (
    GenerationConfig,
    check_shapes,
    load_generation_config,
    load_tokenizer_config,
    read_checked_tensors,
    read_safetensors,
    read_tensors,
)

pytestmark = pytest.mark.serial  # timing bounds: `make test` runs it alone, after the parallel part


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> Path:
    """A safetensors file from raw (dtype, shape, bytes), independent of the library."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))
    return path


@pytest.mark.parametrize("qwen2,tie", [(False, True), (False, False), (True, False)])
def test_sharded_equals_single(tmp_path: Path, qwen2: bool, tie: bool) -> None:
    single = make_tiny_llama(tmp_path / "single", seed=5, qwen2=qwen2, tie=tie)
    sharded = make_tiny_llama(tmp_path / "sharded", seed=5, qwen2=qwen2, tie=tie, sharded=True)
    assert not (sharded / "model.safetensors").exists()
    assert len(list(sharded.glob("model-0000?-of-00002.safetensors"))) == 2
    a, b = read_tensors(single), read_tensors(sharded)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == np.float32 and np.array_equal(a[k], b[k]), k
    check_shapes(b, load_model_config(sharded))
    assert ("lm_head.weight" in a) == (not tie)
    assert ("model.layers.0.self_attn.q_proj.bias" in a) == qwen2


def test_f16_and_bf16_are_widened_to_float32(tmp_path: Path) -> None:
    x = np.array([[1.5, -2.25], [0.0, 65280.0]], dtype=np.float32)
    bf16 = (x.view(np.uint32) >> 16).astype("<u2").tobytes()  # these values are exact in bf16
    path = write_safetensors(
        tmp_path / "m.safetensors",
        {
            "a": ("F16", (2, 2), x.astype("<f2").tobytes()),
            "b": ("BF16", (2, 2), bf16),
            "c": ("F32", (2, 2), x.astype("<f4").tobytes()),
            "s": ("F32", (), np.float32(3).tobytes()),
        },
    )
    got = read_safetensors(path)
    for k in "abc":
        assert got[k].dtype == np.float32 and np.array_equal(got[k], x), k
    assert got["s"].shape == () and got["s"] == 3


def test_missing_dir_config_and_weights_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match="nope.*does not exist"):
        read_tensors(tmp_path / "nope")
    d = make_tiny_llama(tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(ModelDirError, match=r"config.json: file not found"):
        load_model_config(d)
    (d / "model.safetensors").unlink()
    with pytest.raises(
        ModelDirError, match=r"no weights \(model.safetensors, model.safetensors.index.json or model.gguf"
    ):
        read_tensors(d)


def test_bad_json_names_the_file(tmp_path: Path) -> None:
    d = make_tiny_llama(tmp_path / "m", sharded=True)
    for name, load in [
        ("config.json", load_model_config),
        ("generation_config.json", load_generation_config),
        ("tokenizer_config.json", load_tokenizer_config),
        ("model.safetensors.index.json", read_tensors),
    ]:
        good = (d / name).read_text()
        (d / name).write_text(good[:-3])
        with pytest.raises(ModelDirError, match=rf"{name}: not valid JSON"):
            load(d)
        (d / name).write_text("[1, 2]")
        with pytest.raises(ModelDirError, match=rf"{name}: expected a JSON object"):
            load(d)
        (d / name).write_text(good)


def test_missing_shard_and_missing_listed_tensor(tmp_path: Path) -> None:
    d = make_tiny_llama(tmp_path / "m", sharded=True)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["extra.weight"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelDirError, match=r"model-00001-of-00002.safetensors: tensor 'extra.weight' listed"):
        read_tensors(d)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        ModelDirError,
        match=r"index.json: points at shard 'model-00002-of-00002.safetensors', "
        r"which does not exist",
    ):
        read_tensors(d)
    (d / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ModelDirError, match=r"index.json: missing or malformed 'weight_map'"):
        read_tensors(d)


def test_truncated_and_malformed_safetensors(tmp_path: Path) -> None:
    d = make_tiny_llama(tmp_path / "m")
    path = d / "model.safetensors"
    data = path.read_bytes()
    for cut, why in [
        (len(data) - 100, "ends at byte .*truncated file"),
        (40, "truncated safetensors file .header"),
        (5, "truncated safetensors file .5 bytes"),
    ]:
        path.write_bytes(data[:cut])
        with pytest.raises(ModelDirError, match=rf"model.safetensors.*{why}"):
            read_tensors(d)
    (n,) = struct.unpack("<Q", data[:8])
    path.write_bytes(data[:8] + b"{" * n + data[8 + n :])
    with pytest.raises(ModelDirError, match="model.safetensors: malformed safetensors header"):
        read_tensors(d)
    for info, why in [
        ({"dtype": "F8_E4M3", "shape": [1], "data_offsets": [0, 1]}, "unsupported or missing dtype"),
        ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "do not match shape"),
        ({"dtype": "F32", "shape": "x", "data_offsets": [0, 8]}, "malformed shape"),
    ]:
        head = json.dumps({"w": info}).encode()
        path.write_bytes(struct.pack("<Q", len(head)) + head + bytes(8))
        with pytest.raises(ModelDirError, match=f"model.safetensors: tensor 'w'.*{why}"):
            read_tensors(d)


def test_wrong_shape_and_missing_tensor_are_named(tmp_path: Path) -> None:
    d = make_tiny_llama(tmp_path / "m")
    cfg = load_model_config(d)
    tensors = read_tensors(d)
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:, :32]
    with pytest.raises(
        ModelDirError,
        match=r"tensor 'model.layers.1.mlp.up_proj.weight' has shape \[128, 32\], "
        r"expected \[128, 64\]",
    ):
        check_shapes(tensors, cfg)
    del tensors["model.norm.weight"]
    with pytest.raises(ModelDirError, match=r"tensor 'model.norm.weight' is missing \(expected shape \[64\]\)"):
        check_shapes(tensors, cfg)
    cfg_json = json.loads((d / "config.json").read_text())
    cfg_json["tie_word_embeddings"] = False
    (d / "config.json").write_text(json.dumps(cfg_json))
    with pytest.raises(ModelDirError, match=r"model.safetensors: tensor 'lm_head.weight' is missing"):
        read_checked_tensors(d, load_model_config(d))


def test_generation_and_tokenizer_config(tmp_path: Path) -> None:
    d = make_tiny_llama(tmp_path / "m")
    assert load_generation_config(d).eos_token_ids == (IM_END_ID,)
    (d / "generation_config.json").write_text('{"eos_token_id": [2, 7], "temperature": 0.6, "chat_template": "x"}')
    assert load_generation_config(d) == GenerationConfig(eos_token_ids=(2, 7), temperature=0.6, chat_template="x")
    (d / "generation_config.json").write_text('{"eos_token_id": "</s>"}')
    with pytest.raises(ModelDirError, match="generation_config.json: 'eos_token_id' must be a token id"):
        load_generation_config(d)
    (d / "generation_config.json").unlink()
    assert load_generation_config(d) == GenerationConfig()
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<s>", "lstrip": False},
                "eos_token": "</s>",
                "chat_template": [{"name": "default", "template": "a"}, {"name": "tool_use", "template": "b"}],
            }
        )
    )
    t = load_tokenizer_config(d)
    assert (t.bos_token, t.eos_token, t.chat_template) == ("<s>", "</s>", {"default": "a", "tool_use": "b"})
    (d / "tokenizer_config.json").write_text('{"eos_token": 5}')
    with pytest.raises(ModelDirError, match="tokenizer_config.json: 'eos_token' must be a string"):
        load_tokenizer_config(d)


def test_builders_are_fast_and_load(tmp_path: Path) -> None:
    import time

    t0 = time.perf_counter()
    d = make_succ(tmp_path / "succ")
    make_tiny_llama(tmp_path / "tiny", qwen2=True, tie=False, sharded=True)
    assert time.perf_counter() - t0 < 1.0
    cfg = load_model_config(d)
    assert cfg == succ_config() and cfg.vocab_size == BYTE_VOCAB_SIZE
    check_shapes(read_tensors(d), cfg)


def test_succ_argmax_is_the_next_byte_with_a_margin() -> None:
    for i in [*range(256), ENDOFTEXT_ID, IM_END_ID]:
        logits = succ_logits(i)
        want = (i + 1) % 256 if i < 256 else ord("A")
        top2 = np.sort(logits)[-2:]
        assert np.argmax(logits) == want and top2[1] - top2[0] >= SUCC_MARGIN - 0.01, i
        assert logits[ENDOFTEXT_ID] == 0


def test_succ_residual_is_the_embedding() -> None:
    t = succ_tensors(succ_config())
    assert not t["model.layers.0.self_attn.o_proj.weight"].any()
    assert not t["model.layers.0.mlp.down_proj.weight"].any()
