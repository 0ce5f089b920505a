"""The real model shapes `python -m bench synth` writes with random weights: one frozen record each.

Owns: `Shape` (the numbers of one published config.json that a GGUF's metadata and tensor
shapes need), `SHAPES` by name, and `TOKENIZERS` (the shipped GGUFs whose tokenizer a shape's
file copies, with their vocabulary sizes).
The vocabulary is the tokenizer's, not the published one: no model hub is reachable, so a file
copies the tokenizer of a GGUF shipped here (artifacts/models), and its embedding and output
matrices have that tokenizer's rows. Llama 3 and Qwen3 shapes take SmolLM2's (49,152 tokens;
the published 128,256 and 151,936 are in `published_vocab_size`), Gemma 3 shapes Gemma 3's
own (262,144; the 4B's published 262,208 adds 64 image tokens). Everything else is the
published config's, so a layer's matrices and their timing are the real model's.
Must not read files or import jax. Tested by tests/bench/test_synth.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tl.model.config import RopeScaling

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class Tokenizer:
    """A shipped GGUF whose `tokenizer.*` metadata a synthetic file copies."""

    name: str
    path: Path
    vocab_size: int  # len(tokenizer.ggml.tokens): the embedding's rows
    pull: str  # `tl pull <pull>` fetches it


TOKENIZERS = {
    "smollm2": Tokenizer("smollm2", REPO_ROOT / "artifacts/models/smol-135m/model.gguf", 49152, "smol-135m"),
    "gemma3": Tokenizer("gemma3", REPO_ROOT / "artifacts/models/gemma3-270m/model.gguf", 262144, "gemma3-270m"),
}


@dataclass(frozen=True, slots=True)
class Shape:
    """One model's architecture as its config.json publishes it (`source`), in llama.cpp's
    terms (`arch`: general.architecture); `tokenizer` names the TOKENIZERS entry whose vocabulary
    the file has instead of `published_vocab_size`."""

    name: str
    arch: str  # "llama" | "qwen3" | "qwen3moe" | "gemma3"
    source: str  # the Hugging Face repository whose config.json these numbers are
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the dense MLP's (Qwen3-MoE: the config's, unused by its MoE layers)
    published_vocab_size: int
    tokenizer: str
    rope_theta: float
    rms_norm_eps: float
    context_length: int  # max_position_embeddings
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    sliding_window: int = 0  # Gemma 3: the sliding layers' window; every 6th layer is full
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"{self.name}: tokenizer {self.tokenizer!r} is not one of {', '.join(TOKENIZERS)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: {self.num_heads} heads are not a multiple of {self.num_kv_heads} KV heads")
        if (self.arch == "qwen3moe") != (self.num_experts > 0):
            raise ValueError(f"{self.name}: arch {self.arch} with {self.num_experts} experts")

    @property
    def vocab_size(self) -> int:
        """The file's vocabulary: its tokenizer's."""
        return TOKENIZERS[self.tokenizer].vocab_size


_LLAMA32_ROPE = RopeScaling("llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0)
_LLAMA31_ROPE = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)

# Each record is its source's config.json (Gemma 3 4B: its text_config); the sizes in
# `python -m bench synth --list`. The MoE shape is Qwen3-30B-A3B itself (Qwen3's smallest MoE):
# 18.3 GB in Q4_K_M with SmolLM2's vocabulary (18.6 GB published). tl copies the weights into
# anonymous memory and adds ~1.8 GB of its own (measured serving llama3.2-1b's 0.67 GB file:
# 3.1 GB peak RSS, the file's mapped pages included), so ~20 GB: within 24 GiB by that estimate,
# not by a run (Q4_0, 17.0 GB, leaves more room).
# What a family's configs share; each row below is what differs.
_LLAMA3: dict[str, Any] = dict(
    arch="llama",
    tokenizer="smollm2",
    published_vocab_size=128256,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    context_length=131072,
)
_QWEN3: dict[str, Any] = dict(
    tokenizer="smollm2",
    published_vocab_size=151936,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    context_length=40960,
    head_dim=128,
    num_kv_heads=8,
)
_GEMMA3: dict[str, Any] = dict(
    arch="gemma3",
    tokenizer="gemma3",
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    head_dim=256,
    tie_word_embeddings=True,
)
SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("llama3.2-1b", source="meta-llama/Llama-3.2-1B", hidden_size=2048, num_layers=16, num_heads=32,
              num_kv_heads=8, head_dim=64, intermediate_size=8192, tie_word_embeddings=True,
              rope_scaling=_LLAMA32_ROPE, **_LLAMA3),
        Shape("llama3.2-3b", source="meta-llama/Llama-3.2-3B", hidden_size=3072, num_layers=28, num_heads=24,
              num_kv_heads=8, head_dim=128, intermediate_size=8192, tie_word_embeddings=True,
              rope_scaling=_LLAMA32_ROPE, **_LLAMA3),
        Shape("llama3.1-8b", source="meta-llama/Llama-3.1-8B", hidden_size=4096, num_layers=32, num_heads=32,
              num_kv_heads=8, head_dim=128, intermediate_size=14336, tie_word_embeddings=False,
              rope_scaling=_LLAMA31_ROPE, **_LLAMA3),
        Shape("qwen3-0.6b", arch="qwen3", source="Qwen/Qwen3-0.6B", hidden_size=1024, num_layers=28, num_heads=16,
              intermediate_size=3072, tie_word_embeddings=True, **_QWEN3),
        Shape("qwen3-1.7b", arch="qwen3", source="Qwen/Qwen3-1.7B", hidden_size=2048, num_layers=28, num_heads=16,
              intermediate_size=6144, tie_word_embeddings=True, **_QWEN3),
        Shape("qwen3-4b", arch="qwen3", source="Qwen/Qwen3-4B", hidden_size=2560, num_layers=36, num_heads=32,
              intermediate_size=9728, tie_word_embeddings=True, **_QWEN3),
        Shape("qwen3-8b", arch="qwen3", source="Qwen/Qwen3-8B", hidden_size=4096, num_layers=36, num_heads=32,
              intermediate_size=12288, tie_word_embeddings=False, **_QWEN3),
        Shape("qwen3-30b-a3b", arch="qwen3moe", source="Qwen/Qwen3-30B-A3B", hidden_size=2048, num_layers=48,
              num_heads=32, intermediate_size=6144, tie_word_embeddings=False, num_experts=128,
              num_experts_per_tok=8, moe_intermediate_size=768, **{**_QWEN3, "num_kv_heads": 4}),
        Shape("gemma3-1b", source="google/gemma-3-1b-it", hidden_size=1152, num_layers=26, num_heads=4,
              num_kv_heads=1, intermediate_size=6912, published_vocab_size=262144, context_length=32768,
              sliding_window=512, **_GEMMA3),
        Shape("gemma3-4b", source="google/gemma-3-4b-it", hidden_size=2560, num_layers=34, num_heads=8,
              num_kv_heads=4, intermediate_size=10240, published_vocab_size=262208, context_length=131072,
              sliding_window=1024, rope_scaling=RopeScaling("linear", factor=8.0), **_GEMMA3),
    )
}  # fmt: skip
