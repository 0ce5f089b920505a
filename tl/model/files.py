"""Reading a model directory's weight and side files.

Owns: parsing safetensors (model.safetensors, or shards listed by
model.safetensors.index.json) into float32 numpy arrays under Hugging Face names; which weights
file a directory serves (`read_tensors`: a directory holding a GGUF, `model.gguf`, serves its
tensors as the file stores them where asked, tl/model/gguf_model.py `packed_tensors` reading
them; `HostTensor`: a weight as read, float or `Packed`);
checking them against a ModelConfig (`check_shapes`: the shapes tl/model/config.py
`hf_shapes` describes); reading generation_config.json and tokenizer_config.json into frozen
records; the one rule for which ids end generation (`eos_token_ids`). The safetensors parser
is our own (a header and offsets) so every defect becomes a ModelDirError naming the file and
what is wrong, never a library traceback. Must not import jax and must not know the
runner's parameter layout. Tested by tests/model/test_model_files.py.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tl.model.config import ModelConfig, ModelDirError, hf_shapes, read_json
from tl.model.gguf_model import GGUFError, Packed, packed_tensors

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GGUF_FILE = "model.gguf"
"""A GGUF kept in a model directory (`tl pull` keeps the one it converted; a `.gguf` model_dir
gets a directory of its side files with this link to it: tl/model/convert_gguf.py
`gguf_model_dir`)."""
# safetensors dtype -> (numpy dtype of the stored bits, itemsize); BF16 is widened by hand.
_DTYPES: dict[str, np.dtype[Any]] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}


def _header(path: Path, size: int, raw: bytes) -> dict[str, Any]:
    if size < 8:
        raise ModelDirError(f"{path}: truncated safetensors file ({size} bytes, no header)")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > size - 8:
        raise ModelDirError(f"{path}: truncated safetensors file (header of {n} bytes, file has {size})")
    try:
        header = json.loads(raw[8 : 8 + n].decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelDirError(f"{path}: malformed safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ModelDirError(f"{path}: malformed safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    return {"n": n, "tensors": header}


def _entry(path: Path, name: str, info: Any, data_size: int) -> tuple[np.dtype[Any], tuple[int, ...], int, int]:
    bad = f"{path}: tensor {name!r}"
    if not isinstance(info, dict) or info.get("dtype") not in _DTYPES:
        dtype = info.get("dtype") if isinstance(info, dict) else info
        raise ModelDirError(f"{bad} has unsupported or missing dtype {dtype!r}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)):
        raise ModelDirError(f"{bad} has a malformed shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise ModelDirError(f"{bad} has malformed data_offsets {offsets!r}")
    dt = _DTYPES[info["dtype"]]
    begin, end = offsets
    if end - begin != math.prod(shape) * dt.itemsize or begin < 0:
        raise ModelDirError(f"{bad}: data_offsets {offsets} do not match shape {shape} of {info['dtype']}")
    if end > data_size:
        raise ModelDirError(f"{bad} ends at byte {end} but the data section has {data_size} (truncated file?)")
    return dt, tuple(shape), begin, end


def _to_float32(bits: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.astype(np.float32)


def _map(path: Path, size: int) -> np.ndarray:
    """The whole file mapped read-only, its pages populated at once where the kernel can
    (MAP_POPULATE: faulting 538 MB in 4 KiB pieces as the weights are first read cost seconds)."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    with path.open("rb") as f:
        if size == 0:
            return np.zeros(0, np.uint8)
        m = mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ)
    return np.frombuffer(m, dtype=np.uint8)


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file as a float32 array: float32 tensors are read-only views
    of the memory-mapped file (no copy: the runner's placement copies each weight once, into its
    device buffer); other dtypes are converted into arrays of their own."""
    if not path.is_file():
        raise ModelDirError(f"{path}: file not found")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        hdr = _header(path, size, head + f.read(min(n, max(size - 8, 0))))
    start = 8 + hdr["n"]
    data = _map(path, size)
    out = {}
    for name, info in hdr["tensors"].items():
        dt, shape, begin, end = _entry(path, name, info, size - start)
        bits = data[start + begin : start + end].view(dt).reshape(shape)
        if info["dtype"] == "F32" and bits.dtype == np.dtype("<f4"):
            out[name] = bits
        else:
            out[name] = np.array(_to_float32(bits, info["dtype"]), dtype=np.float32, copy=True)
    return out


def _read_sharded(model_dir: Path) -> dict[str, np.ndarray]:
    index_path = model_dir / INDEX_FILE
    weight_map = read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelDirError(f"{index_path}: missing or malformed 'weight_map'")
    out: dict[str, np.ndarray] = {}
    for shard in sorted(set(weight_map.values())):
        if not (model_dir / shard).is_file():
            raise ModelDirError(f"{index_path}: points at shard {shard!r}, which does not exist in {model_dir}")
        out.update(read_safetensors(model_dir / shard))
    for name, shard in weight_map.items():
        if name not in out:
            raise ModelDirError(f"{model_dir / shard}: tensor {name!r} listed in {INDEX_FILE} is missing")
    return out


HostTensor = np.ndarray | Packed
"""A weight as read from its file: float numpy, or packed blocks."""


def read_tensors(model_dir: str | Path, *, packed: bool = False) -> dict[str, Any]:
    """All weights of a model dir by HF name: float32 arrays from model.safetensors (which wins
    over an index); with `packed`, or where the directory has no safetensors, the tensors of its
    GGUF (`GGUF_FILE`) as the file stores them (`Packed` blocks, float arrays for F32/F16/BF16)."""
    d = Path(model_dir)
    if not d.is_dir():
        raise ModelDirError(f"model directory {str(model_dir)!r} does not exist")
    has_float = (d / SINGLE_FILE).is_file() or (d / INDEX_FILE).is_file()
    if (d / GGUF_FILE).exists() and (packed or not has_float):
        try:
            return packed_tensors(d / GGUF_FILE)
        except GGUFError as e:
            raise ModelDirError(str(e)) from None
    if (d / SINGLE_FILE).is_file():
        return read_safetensors(d / SINGLE_FILE)
    if (d / INDEX_FILE).is_file():
        return _read_sharded(d)
    raise ModelDirError(f"{d}: no weights ({SINGLE_FILE}, {INDEX_FILE} or {GGUF_FILE} not found)")


def has_gguf(model_dir: str | Path) -> bool:
    """Whether the directory keeps a GGUF (what weight_dtype "auto" then serves)."""
    return (Path(model_dir) / GGUF_FILE).exists()


def check_shapes(tensors: dict[str, np.ndarray], cfg: ModelConfig, source: str = "weights") -> None:
    """Raise ModelDirError naming the first missing tensor or the expected vs actual shape.
    Extra tensors (e.g. a tied model's stored lm_head) are allowed."""
    for name, shape in hf_shapes(cfg).items():
        if name not in tensors:
            raise ModelDirError(f"{source}: tensor {name!r} is missing (expected shape {list(shape)})")
        if tuple(tensors[name].shape) != shape:
            raise ModelDirError(
                f"{source}: tensor {name!r} has shape {list(tensors[name].shape)}, "
                f"expected {list(shape)} from config.json"
            )


def read_checked_tensors(model_dir: str | Path, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """read_tensors + check_shapes, the error naming the weights file of the dir."""
    tensors = read_tensors(model_dir)
    d = Path(model_dir)
    check_shapes(tensors, cfg, source=str(d / (SINGLE_FILE if (d / SINGLE_FILE).is_file() else INDEX_FILE)))
    return tensors


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    """What we use of generation_config.json (all optional)."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    chat_template: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    """What we use of tokenizer_config.json (all optional)."""

    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    chat_template: str | dict[str, str] | None = None
    add_bos_token: bool = False  # prompts begin with bos_token (Gemma, Llama 2): Tokenizer.encode_prompt


def _ids(value: Any, source: str, key: str) -> tuple[int, ...]:
    if value is None:
        return ()
    vals = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in vals):
        raise ModelDirError(f"{source}: {key!r} must be a token id or a list of them, got {value!r}")
    return tuple(vals)


def _opt(d: dict[str, Any], key: str, kinds: tuple[type, ...], source: str) -> Any:
    v = d.get(key)
    if v is not None and (not isinstance(v, kinds) or isinstance(v, bool)):
        raise ModelDirError(f"{source}: {key!r} has the wrong type ({v!r})")
    return v


def load_generation_config(model_dir: str | Path) -> GenerationConfig:
    """generation_config.json; defaults when the file is absent (it is optional in HF dirs)."""
    path = Path(model_dir) / "generation_config.json"
    d, src = read_json(path, required=False), str(path)
    template = _opt(d, "chat_template", (str,), src)
    return GenerationConfig(
        eos_token_ids=_ids(d.get("eos_token_id"), src, "eos_token_id"),
        bos_token_id=(_ids(d.get("bos_token_id"), src, "bos_token_id") or (None,))[0],
        chat_template=template,
        temperature=_opt(d, "temperature", (int, float), src),
        top_p=_opt(d, "top_p", (int, float), src),
        top_k=_opt(d, "top_k", (int,), src),
    )


def _token_str(value: Any, source: str, key: str) -> str | None:
    """A special token given as a string or as a serialized AddedToken ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ModelDirError(f"{source}: {key!r} must be a string, got {value!r}")
    return value


def _chat_template(value: Any, source: str) -> str | dict[str, str] | None:
    """A template string, or named templates given as a dict or as [{"name", "template"}]."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        try:
            value = {t["name"]: t["template"] for t in value}
        except (TypeError, KeyError):
            raise ModelDirError(f"{source}: 'chat_template' list entries need 'name' and 'template'") from None
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return value
    raise ModelDirError(f"{source}: 'chat_template' must be a string or named templates, got {type(value).__name__}")


def eos_token_ids(model_dir: str | Path, token_to_id: Callable[[str], int | None] | None = None) -> tuple[int, ...]:
    """Every id that ends generation, once each, in this order: generation_config.json's
    eos_token_id, config.json's, and tokenizer_config.json's eos_token looked up by
    `token_to_id` (a loaded tokenizer's; default: read from tokenizer.json). The runner (which
    stops sequences) and the Tokenizer both use this; like vLLM, a sequence stops at the
    tokenizer's EOS token and at every generation_config id."""
    d = Path(model_dir)
    ids = list(load_generation_config(d).eos_token_ids)
    ids += _ids(
        read_json(d / "config.json", required=False).get("eos_token_id"), str(d / "config.json"), "eos_token_id"
    )
    eos = load_tokenizer_config(d).eos_token
    lookup = token_to_id or (lambda token: _vocab_id(d / "tokenizer.json", token))
    if eos is not None and (i := lookup(eos)) is not None:
        ids.append(i)
    return tuple(dict.fromkeys(ids))


def _vocab_id(path: Path, token: str) -> int | None:
    """`token`'s id in tokenizer.json: its added tokens, then its model's vocab (a dict, or
    Unigram's list of [piece, score]); None when absent."""
    spec = read_json(path, required=False)
    for t in spec.get("added_tokens") or []:
        if isinstance(t, dict) and t.get("content") == token and isinstance(t.get("id"), int):
            return int(t["id"])
    vocab = (spec.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and isinstance(vocab.get(token), int):
        return int(vocab[token])
    if isinstance(vocab, list):
        return next((i for i, v in enumerate(vocab) if isinstance(v, list) and v and v[0] == token), None)
    return None


def load_tokenizer_config(model_dir: str | Path) -> TokenizerConfig:
    """tokenizer_config.json; defaults when the file is absent."""
    path = Path(model_dir) / "tokenizer_config.json"
    d, src = read_json(path, required=False), str(path)
    return TokenizerConfig(
        **{k: _token_str(d.get(k), src, k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")},
        chat_template=_chat_template(d.get("chat_template"), src),
        add_bos_token=d.get("add_bos_token") is True,
    )
