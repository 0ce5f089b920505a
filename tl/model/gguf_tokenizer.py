"""A GGUF's tokenizer as Hugging Face files: tokenizer.json and tokenizer_config.json.

Owns: reading the `tokenizer.ggml.*` metadata of a llama.cpp GGUF into a `TokenizerMeta`, and
writing from it a `tokenizers` tokenizer.json that tokenizes as llama.cpp does on that file:
- BPE "gpt2" vocabularies (SmolLM2, Qwen): byte-level BPE with the file's merges and the
  pre-tokenizer its `tokenizer.ggml.pre` names;
- SentencePiece "llama" vocabularies (Gemma, Llama 2, Mistral): BPE with byte fallback over
  `▁`-for-space pieces, merges derived from the pieces' scores (llama.cpp's SPM tokenizer merges
  the adjacent pair whose joined piece scores best; a BPE whose merges are ranked by that score
  makes the same choices), a space prefix where `tokenizer.ggml.add_space_prefix` says so.
Control tokens become special added tokens and user-defined ones plain added tokens, matched
whole in the raw text as llama.cpp does. tokenizer_config.json carries `add_bos_token`
(`tokenizer.ggml.add_bos_token`; llama.cpp's default: on for SentencePiece, off for BPE).
Must not import jax or transformers. Errors are GGUFError naming the file and the key.
Tested by tests/model/test_gguf_tokenizer.py (tiny vocabularies against transformers' GGUF builders,
and Gemma 3's against llama.cpp's ids in tests/golden/, slow) and tests/model/test_convert_gguf.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tl.model.gguf_file import GGUFFile

TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_BYTE = 1, 3, 4, 6
TOKENIZER_MODELS = ("gpt2", "llama")
SPACE = "\u2581"  # SentencePiece's '▁', which stands for a space in its pieces


class GGUFError(ValueError):
    """The GGUF file cannot be converted; the message names the file and the reason."""


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


@dataclass(frozen=True, slots=True)
class TokenizerMeta:
    """What a GGUF says about its tokenizer (`tokenizer.ggml.*`)."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str  # the BPE pre-tokenizer's name; "default" for SentencePiece
    tokens: tuple[str, ...]
    types: tuple[int, ...]
    scores: tuple[float, ...]  # SentencePiece piece scores (higher merges first); () for BPE
    merges: tuple[str, ...]  # BPE merges, "left right"; () for SentencePiece
    ids: dict[str, int | None]  # bos, eos, unknown, padding
    add_bos_token: bool
    add_eos_token: bool
    add_space_prefix: bool  # SentencePiece: a '▁' before the text (and after each added token)
    chat_template: str | None


def tokenizer_meta(reader: GGUFFile, path: Path) -> TokenizerMeta:
    """The tokenizer metadata of the GGUF at `path`; GGUFError names an unsupported
    `tokenizer.ggml.model` / `tokenizer.ggml.pre`, or a missing key."""
    model = reader.field("tokenizer.ggml.model")
    if model not in TOKENIZER_MODELS:
        raise GGUFError(
            f"{path}: tokenizer.ggml.model {model!r} is not supported (supported: {', '.join(TOKENIZER_MODELS)})"
        )
    pre = reader.field("tokenizer.ggml.pre", "default")
    if model == "gpt2" and pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(PRE_TOKENIZERS)})")
    tokens = reader.field("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError(f"{path}: missing metadata key 'tokenizer.ggml.tokens'")
    spm = model == "llama"
    scores = reader.field("tokenizer.ggml.scores") if spm else ()
    if spm and (scores is None or len(scores) != len(tokens)):
        raise GGUFError(f"{path}: tokenizer.ggml.scores must give one score per token ({len(tokens)})")
    if spm and reader.field("tokenizer.ggml.remove_extra_whitespaces", False):
        raise GGUFError(f"{path}: tokenizer.ggml.remove_extra_whitespaces true is not supported")
    types = reader.field("tokenizer.ggml.token_type", [TOKEN_TYPE_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise GGUFError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    return TokenizerMeta(
        model=model,
        pre=pre,
        tokens=tuple(tokens),
        types=tuple(int(t) for t in types),
        scores=tuple(float(s) for s in scores),
        merges=tuple(reader.field("tokenizer.ggml.merges", [])),
        ids={k: reader.field(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")},
        add_bos_token=bool(reader.field("tokenizer.ggml.add_bos_token", spm)),
        add_eos_token=bool(reader.field("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(reader.field("tokenizer.ggml.add_space_prefix", spm)),
        chat_template=reader.field("tokenizer.chat_template"),
    )


def _added_tokens(tok: TokenizerMeta) -> list[dict[str, Any]]:
    """Control tokens as special added tokens, user-defined ones as plain added tokens, both
    matched in the raw text (normalized False), as llama.cpp partitions the text by them."""
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
        for i, (s, ty) in enumerate(zip(tok.tokens, tok.types, strict=True))
        if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]


def tokenizer_json(tok: TokenizerMeta, path: Path) -> dict[str, Any]:
    """tokenizer.json for `tok`: byte-level BPE for "gpt2", byte-fallback BPE over
    SentencePiece pieces for "llama"."""
    vocab = {s: i for i, s in enumerate(tok.tokens)}
    if len(vocab) != len(tok.tokens):
        raise GGUFError(f"{path}: tokenizer.ggml.tokens has duplicate entries")
    spec = _spm_json(tok, vocab) if tok.model == "llama" else _bpe_json(tok, vocab)
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": _added_tokens(tok), **spec}


def _bpe_json(tok: TokenizerMeta, vocab: dict[str, int]) -> dict[str, Any]:
    return {
        "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[tok.pre],
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": _bpe_model(vocab, [m.split(" ") for m in tok.merges], byte_fallback=False, unk=None),
    }


def _spm_json(tok: TokenizerMeta, vocab: dict[str, int]) -> dict[str, Any]:
    replace: dict[str, Any] = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
    normalizer: dict[str, Any] = replace
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if tok.add_space_prefix:  # applied to each stretch of text between added tokens, as llama.cpp does
        normalizer = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE}, replace]}
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    unk = tok.ids.get("unknown")
    return {
        "normalizer": normalizer,
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": _bpe_model(
            vocab,
            spm_merges(tok.tokens, tok.scores),
            byte_fallback=True,
            unk=tok.tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tok.tokens) else None,
        ),
    }


def _bpe_model(
    vocab: dict[str, int], merges: list[list[str]], *, byte_fallback: bool, unk: str | None
) -> dict[str, Any]:
    return {
        "type": "BPE",
        "dropout": None,
        "unk_token": unk,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": byte_fallback,
        "byte_fallback": byte_fallback,
        "ignore_merges": False,
        "vocab": vocab,
        "merges": merges,
    }


def spm_merges(tokens: tuple[str, ...], scores: tuple[float, ...]) -> list[list[str]]:
    """Every split of a piece into two pieces, as a merge, best first: by the joined piece's
    score (llama.cpp merges the adjacent pair whose joined piece scores highest), then by its id,
    then the longer left half first (as transformers orders them). Normal pieces' scores are
    unique, so only two splits of one piece can tie, and they compete only when they overlap
    ([ab][a][ba] -> "aba"): llama.cpp joins the leftmost, the longer left half here."""
    vocab = set(tokens)
    ranked = []
    for i, piece in enumerate(tokens):
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, -k, left, right))
    ranked.sort(key=lambda m: m[:3])
    return [[left, right] for *_, left, right in ranked]


def tokenizer_config(tok: TokenizerMeta, max_length: int) -> dict[str, Any]:
    def name(key: str) -> str | None:
        i = tok.ids[key]
        return tok.tokens[i] if isinstance(i, int) and 0 <= i < len(tok.tokens) else None

    decoder = {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in _added_tokens(tok)}
    return {
        "add_bos_token": tok.add_bos_token,
        "add_eos_token": tok.add_eos_token,
        "added_tokens_decoder": decoder,
        "bos_token": name("bos"),
        "eos_token": name("eos"),
        "unk_token": name("unknown"),
        "pad_token": name("padding"),
        "chat_template": tok.chat_template,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "tokenizer_class": "GPT2Tokenizer" if tok.model == "gpt2" else "PreTrainedTokenizerFast",
    }
