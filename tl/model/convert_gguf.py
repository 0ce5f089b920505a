"""GGUF -> Hugging Face model directory (`tl convert-gguf`), and a GGUF served as it is.

Owns: reading a llama.cpp GGUF file (llama and qwen2 architectures, BPE "gpt2"
tokenizers) and writing config.json, model.safetensors (float32, HF tensor names),
tokenizer.json, tokenizer_config.json and generation_config.json. Dequantizes with
`gguf.quants.dequantize` and undoes llama.cpp's q/k row permutation for llama.
Serving a GGUF as it is: `packed_tensors` (its tensors under HF names, block formats kept as
the file's bytes, `Packed`, rows un-permuted; a type tl does not serve refused naming the
tensor, its type and the types served) and `gguf_model_dir` (a `.gguf` model_dir becomes a
directory of the side files with a link to the GGUF, so every reader of a model directory
serves it).
Must not import jax and must not know the runner's parameter layout (HF names only).
Errors (not a GGUF, unsupported architecture, tokenizer or tensor type) are GGUFError
naming the file. Tested by tests/test_convert_gguf.py (small GGUFs written with
gguf.GGUFWriter, plus the real SmolLM2 file, marked slow).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm

from tl.model.config import ModelConfig
from tl.model.files import GGUF_FILE, Packed

Q = gguf.GGMLQuantizationType
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Pre-tokenizers by `tokenizer.ggml.pre`, as the Hugging Face tokenizer.json of those models has them.
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_BYTE_LEVEL_NO_REGEX = {**_BYTE_LEVEL, "use_regex": False}
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
    "gpt-2": _BYTE_LEVEL,
    "default": _BYTE_LEVEL,
    "qwen2": {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": _QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
            _BYTE_LEVEL_NO_REGEX,
        ],
    },
}


class GGUFError(ValueError):
    """The GGUF file cannot be converted; the message names the file and the reason."""


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True, *, keep: bool = False) -> Path:
    """Write a Hugging Face model directory for `gguf_path` into `out_dir` (created); `keep`:
    move the GGUF in as well (`GGUF_FILE`), for weight_dtype "auto" to serve as it is."""
    path = Path(gguf_path)
    reader = open_gguf(path)
    cfg = gguf_model_config(reader, path)
    tensors = hf_tensors(reader, cfg, path, progress=progress)
    out = _side_files(reader, cfg, path, Path(out_dir))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors creates it 0600
    if keep:
        del reader, tensors  # the mapping closes before the move
        path.replace(out / GGUF_FILE)
    return out


def _side_files(reader: gguf.GGUFReader, cfg: ModelConfig, path: Path, out: Path) -> Path:
    """config.json, the tokenizer's files and generation_config.json of the GGUF into `out`."""
    tok = _tokenizer_metadata(reader, path)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", cfg.to_dict())
    _write_json(out / "tokenizer.json", tokenizer_json(tok, path))
    _write_json(out / "tokenizer_config.json", tokenizer_config(tok, cfg))
    _write_json(out / "generation_config.json", _generation_config(cfg))
    return out


def gguf_model_dir(gguf_path: str | Path, cache_dir: str | Path = "") -> Path:
    """The model directory that serves `gguf_path` as it is: its side files (config, tokenizer,
    generation config) and `GGUF_FILE`, a link to it, under `cache_dir` (empty:
    ~/.cache/tl/gguf), written once per file (keyed by its path, size and time). The
    directory's name is the file's stem, so the served model's name is the file's."""
    path = Path(gguf_path).resolve()
    st = path.stat() if path.is_file() else None
    if st is None:
        raise GGUFError(f"{gguf_path}: file not found")
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "tl" / "gguf"
    out = root / key / path.stem
    if (out / GGUF_FILE).exists() and (out / "config.json").is_file():
        return out
    with tempfile.TemporaryDirectory(dir=_mkdir(root)) as tmp:
        reader = open_gguf(path)
        staged = _side_files(reader, gguf_model_config(reader, path), path, Path(tmp) / path.stem)
        (staged / GGUF_FILE).symlink_to(path)
        (root / key).mkdir(exist_ok=True)
        try:
            staged.rename(out)
        except OSError:  # written meanwhile by another process: theirs serves
            if not (out / "config.json").is_file():
                raise
    return out


def _mkdir(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    return d


def model_dir_of(model_dir: str) -> str:
    """A model directory as given, or for a `.gguf` file the directory that serves it."""
    if Path(model_dir).is_file() and model_dir.endswith(".gguf"):
        return str(gguf_model_dir(model_dir))
    return model_dir


def served_types() -> tuple[str, ...]:
    """The GGUF tensor types a model can be served in as they are (F32/F16/BF16 read as float)."""
    from tl.model.encodings.ggml_formats import FORMATS

    return ("F32", "F16", "BF16", *(f.upper() for f in FORMATS))


def packed_tensors(path: Path) -> dict[str, np.ndarray | Packed]:
    """Every tensor of the GGUF at `path` under its HF name, as the file stores it: block formats
    as `Packed` (views of the mapped file where no rows move), F32 as float32, F16 and BF16
    widened to float32; llama's q/k rows un-permuted. A tensor type tl does not serve raises
    GGUFError naming the tensor, its type and the served types."""
    from tl.model.encodings.ggml_formats import by_ggml_type

    reader = open_gguf(path)
    cfg = gguf_model_config(reader, path)
    out: dict[str, np.ndarray | Packed] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        ttype = Q(t.tensor_type)
        fmt = by_ggml_type(int(ttype))
        w: np.ndarray | Packed
        if fmt is not None:
            w = Packed(fmt.name, t.data.reshape(-1, t.data.shape[-1]), int(t.shape[0]))
            w = w.with_rows(w.data.reshape(*(int(n) for n in reversed(t.shape[1:])), w.data.shape[-1]))
        else:  # F32, F16 and BF16 as float32; any other type refused there
            w = dequantize_tensor(t, path)
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
        part = name.split(".")[-2]
        if cfg.architecture == "LlamaForCausalLM" and part in heads:
            w = (
                w.with_rows(unpermute_qk(w.data, heads[part]))
                if isinstance(w, Packed)
                else unpermute_qk(w, heads[part])
            )
        out[name] = w
    if "model.embed_tokens.weight" not in out:
        raise GGUFError(f"{path}: tensor 'token_embd.weight' is missing")
    return out


def open_gguf(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise GGUFError(f"{path}: file not found")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (bad magic)")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 (a damaged file raises ValueError, IndexError, struct.error, ...)
        raise GGUFError(f"{path}: malformed GGUF ({type(e).__name__}: {e})") from None


def field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as a Python scalar, string or list; `default` when absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _need(reader: gguf.GGUFReader, key: str, path: Path) -> Any:
    v = field(reader, key)
    if v is None:
        raise GGUFError(f"{path}: missing metadata key {key!r}")
    return v


def _f32_round(x: float) -> float:
    """Shortest decimal that is the same float32 (9.999999747e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def gguf_model_config(reader: gguf.GGUFReader, path: Path) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    hidden = int(_need(reader, f"{arch}.embedding_length", path))
    heads = int(_need(reader, f"{arch}.attention.head_count", path))
    tokens = field(reader, "tokenizer.ggml.tokens") or []
    eos = [field(reader, "tokenizer.ggml.eos_token_id"), field(reader, "tokenizer.ggml.eot_token_id")]
    names = {t.name for t in reader.tensors}
    return ModelConfig(
        architecture=ARCHITECTURES[arch],
        vocab_size=int(field(reader, f"{arch}.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(_need(reader, f"{arch}.feed_forward_length", path)),
        num_hidden_layers=int(_need(reader, f"{arch}.block_count", path)),
        num_attention_heads=heads,
        num_key_value_heads=int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=_f32_round(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=_f32_round(_need(reader, f"{arch}.attention.layer_norm_rms_epsilon", path)),
        max_position_embeddings=int(field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
    )


def hf_name(gguf_name: str) -> str | None:
    """The HF tensor name of a GGUF tensor name, or None for tensors HF does not store (rope_freqs)."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{kind}"
    return None


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's HF->GGUF q/k permutation: rows [n_head, 2, hd/2] -> [n_head, hd/2, 2]."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Exact inverse of permute_qk: rows [n_head, hd/2, 2] -> [n_head, 2, hd/2]."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(t: gguf.ReaderTensor, path: Path) -> np.ndarray:
    """float32 array in HF/numpy order ([out, in] for matrices)."""
    ttype = Q(t.tensor_type)
    if ttype.name not in served_types():
        raise GGUFError(
            f"{path}: tensor {t.name!r} has type {ttype.name}, which tl does not serve "
            f"(served: {', '.join(served_types())})"
        )
    shape = tuple(int(n) for n in reversed(t.shape))
    return np.ascontiguousarray(gguf.quants.dequantize(t.data, ttype), dtype=np.float32).reshape(shape)


def hf_tensors(reader: gguf.GGUFReader, cfg: ModelConfig, path: Path, progress: bool = True) -> dict[str, np.ndarray]:
    """All tensors, dequantized, renamed to HF names, q/k un-permuted for llama."""
    out: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc=f"convert {path.name}", unit="tensor", file=sys.stderr, disable=not progress):
        name = hf_name(t.name)
        if name is None:
            continue
        w = dequantize_tensor(t, path)
        if cfg.architecture == "LlamaForCausalLM" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_qk(w, cfg.num_attention_heads)
        elif cfg.architecture == "LlamaForCausalLM" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_qk(w, cfg.num_key_value_heads)
        out[name] = w
    if "model.embed_tokens.weight" not in out:
        raise GGUFError(f"{path}: tensor 'token_embd.weight' is missing")
    return out


def _tokenizer_metadata(reader: gguf.GGUFReader, path: Path) -> dict[str, Any]:
    model = field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(f"{path}: tokenizer.ggml.model {model!r} is not supported (only BPE 'gpt2')")
    pre = field(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(PRE_TOKENIZERS)})")
    tokens = _need(reader, "tokenizer.ggml.tokens", path)
    return {
        "tokens": tokens,
        "pre": pre,
        "merges": field(reader, "tokenizer.ggml.merges", []),
        "types": field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)),
        "chat_template": field(reader, "tokenizer.chat_template"),
        "ids": {k: field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")},
    }


def _added_tokens(tok: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "id": i,
            "content": s,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": ty == TOKEN_TYPE_CONTROL,
        }
        for i, (s, ty) in enumerate(zip(tok["tokens"], tok["types"], strict=False))
        if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]


def tokenizer_json(tok: dict[str, Any], path: Path) -> dict[str, Any]:
    """A `tokenizers` BPE with the GGUF vocab and merges, ByteLevel decoder."""
    vocab = {s: i for i, s in enumerate(tok["tokens"])}
    if len(vocab) != len(tok["tokens"]):
        raise GGUFError(f"{path}: tokenizer.ggml.tokens has duplicate entries")
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(tok),
        "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[tok["pre"]],
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": list(tok["merges"]),
        },
    }


def tokenizer_config(tok: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    def name(key: str) -> str | None:
        i = tok["ids"][key]
        return tok["tokens"][i] if isinstance(i, int) and 0 <= i < len(tok["tokens"]) else None

    decoder = {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in _added_tokens(tok)}
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": decoder,
        "bos_token": name("bos"),
        "eos_token": name("eos"),
        "unk_token": name("unknown"),
        "pad_token": name("padding"),
        "chat_template": tok["chat_template"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.max_position_embeddings,
        "tokenizer_class": "GPT2Tokenizer",
    }


def _generation_config(cfg: ModelConfig) -> dict[str, Any]:
    eos: int | list[int] | None = list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1 else cfg.eos_token_ids[0]
    return {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos}


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
