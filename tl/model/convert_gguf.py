"""GGUF -> Hugging Face model directory (`tl convert-gguf`, `tl pull`, a `.gguf` model_dir).

Owns: writing a Hugging Face directory for a GGUF: config.json (tl/model/gguf_model.py
`gguf_model_config`), model.safetensors (float32, every tensor dequantized under its HF name:
`hf_tensors`), the tokenizer's files (tl/model/gguf_tokenizer.py) and generation_config.json
(`convert_gguf`, which can also keep the GGUF in the directory as `GGUF_FILE` for weight_dtype
"auto" to serve as it is); and the directory that serves a `.gguf` model_dir as it is
(`gguf_model_dir`: the side files and a link to the GGUF, written once per file;
`model_dir_of`). Reading the GGUF (its config, HF names, tensors) is tl/model/gguf_model.py's.
Must not import jax and must not know the runner's parameter layout (HF names only).
Errors are GGUFError naming the file. Tested by tests/model/test_convert_gguf.py and
tests/model/test_gguf_families.py (small GGUFs written with gguf.GGUFWriter, plus the real SmolLM2
and Gemma 3 files, slow).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm

from tl.model.config import ModelConfig
from tl.model.files import GGUF_FILE
from tl.model.gguf_file import GGUFFile
from tl.model.gguf_model import (
    GGUFError,
    check_names,
    check_served,
    dequantize_tensor,
    gguf_model_config,
    hf_name,
    open_gguf,
    to_hf,
)
from tl.model.gguf_tokenizer import tokenizer_config, tokenizer_json, tokenizer_meta

__all__ = ["GGUFError", "convert_gguf", "gguf_model_dir", "model_dir_of"]


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, progress: bool = True, *, keep: bool = False, float_weights: bool = True
) -> Path:
    """Write a Hugging Face model directory for `gguf_path` into `out_dir` (created); `keep`:
    move the GGUF in as well (`GGUF_FILE`), for weight_dtype "auto" to serve as it is;
    `float_weights` False (only with `keep`): no model.safetensors, the GGUF is the weights."""
    if not (float_weights or keep):
        raise ValueError("convert_gguf: float_weights=False needs keep=True (the GGUF is then the only weights)")
    path = Path(gguf_path)
    reader = open_gguf(path)
    cfg = gguf_model_config(reader, path)
    if float_weights:
        tensors = hf_tensors(reader, cfg, path, progress=progress)
    else:  # what serving the GGUF as it is would refuse, refused now
        check_served(reader, cfg, path)
        tensors = {}
    out = _side_files(reader, cfg, path, Path(out_dir))
    if tensors:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "model.safetensors").chmod(0o644)  # safetensors creates it 0600
    del tensors
    if keep:
        del reader  # the mapping closes before the move
        path.replace(out / GGUF_FILE)
    return out


def _side_files(reader: GGUFFile, cfg: ModelConfig, path: Path, out: Path) -> Path:
    """config.json, the tokenizer's files and generation_config.json of the GGUF into `out`."""
    tok = tokenizer_meta(reader, path)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", cfg.to_dict())
    _write_json(out / "tokenizer.json", tokenizer_json(tok, path))
    _write_json(out / "tokenizer_config.json", tokenizer_config(tok, cfg.max_position_embeddings))
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


def hf_tensors(reader: GGUFFile, cfg: ModelConfig, path: Path, progress: bool = True) -> dict[str, np.ndarray]:
    """All tensors, dequantized, under HF names, llama.cpp's conventions undone (`to_hf`)."""
    out: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc=f"convert {path.name}", unit="tensor", file=sys.stderr, disable=not progress):
        name = hf_name(t.name, cfg.architecture)
        if name is not None:
            out |= {n: np.ascontiguousarray(w) for n, w in to_hf(cfg, name, dequantize_tensor(t, path), path)}
    check_names(set(out), cfg, path)
    return out


def _generation_config(cfg: ModelConfig) -> dict[str, Any]:
    eos: int | list[int] | None = list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1 else cfg.eos_token_ids[0]
    return {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos}


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
