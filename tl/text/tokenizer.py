"""Tokenizer: text <-> token ids over a model dir's tokenizer.json, and token bytes for streaming.

Owns: loading tokenizer.json with the `tokenizers` library; encoding without adding
special tokens (chat templates carry BOS) while matching special tokens written in
the text, and a prompt's encoding (`encode_prompt`: BOS first where tokenizer_config.json's
add_bos_token asks, as llama.cpp adds it for Gemma's and Llama 2's vocabularies, unless the
text already begins with it); the per-token byte table (`token_bytes`) that lets a streamer
join bytes and decode UTF-8 incrementally (SentencePiece pieces: '▁' a space, <0xNN> a byte).
Must not import jax, render chat templates (tl/text/chat_template.py does) or decide which
ids end generation (the engine's `eos_token_ids`, by tl.model.files' rule). Tested by
tests/text/test_tokenizer.py (byte tokenizer of tests/helpers/models.py, and SmolLM2's tokenizer
against transformers' independent GGUF tokenizer, marked slow) and
tests/model/test_gguf_tokenizer.py (SentencePiece vocabularies, BOS on prompts).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

import tokenizers

from tl.model.config import ModelDirError, read_json
from tl.model.files import load_tokenizer_config

_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def byte_level_alphabet() -> tuple[str, ...]:
    """GPT-2's bytes_to_unicode: the printable character that stands for each byte 0..255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return tuple(chars[b] for b in range(256))


@cache
def _byte_of_char() -> dict[str, int]:
    return {ch: b for b, ch in enumerate(byte_level_alphabet())}


def _has_type(node: Any, kind: str) -> bool:
    """Whether a tokenizer.json component (possibly a Sequence) contains a `kind` step."""
    if not isinstance(node, dict):
        return False
    if node.get("type") == kind:
        return True
    return any(_has_type(n, kind) for key in ("decoders", "pretokenizers") for n in node.get(key) or [])


def _piece_bytes(piece: str, byte_level: bool) -> bytes:
    """The bytes a vocab entry stands for: byte-level characters mapped back, else
    SentencePiece conventions ('▁' is a space, '<0xNN>' is one byte)."""
    if byte_level:
        table = _byte_of_char()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return piece.encode("utf-8")
    if m := _HEX_BYTE.fullmatch(piece):
        return bytes([int(m.group(1), 16)])
    return piece.replace("▁", " ").encode("utf-8")


class Tokenizer:
    """A model's tokenizer. Build with Tokenizer.load(model_dir)."""

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        spec: dict[str, Any],
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = False,
    ) -> None:
        self._tok = tok
        self._bos_token, self._eos_token = bos_token, eos_token
        bos_id = None if bos_token is None else tok.token_to_id(bos_token)
        self._bos_prefix = [bos_id] if add_bos_token and bos_id is not None else []
        self._byte_level = _has_type(spec.get("decoder"), "ByteLevel")
        added = {int(i): t for i, t in tok.get_added_tokens_decoder().items()}
        self._special = {t.content: i for i, t in added.items() if t.special}
        self._special_ids = frozenset(self._special.values())
        self._table = self._byte_table(added)

    def _byte_table(self, added: dict[int, tokenizers.AddedToken]) -> tuple[bytes, ...]:
        n = self._tok.get_vocab_size(with_added_tokens=True)
        size = max([n, *(i + 1 for i in added)])
        table = []
        for i in range(size):
            if i in added:
                table.append(added[i].content.encode("utf-8"))
            else:
                piece = self._tok.id_to_token(i)
                table.append(b"" if piece is None else _piece_bytes(piece, self._byte_level))
        return tuple(table)

    @classmethod
    def load(cls, model_dir: str | Path) -> Tokenizer:
        d = Path(model_dir)
        path = d / "tokenizer.json"
        spec = read_json(path)
        try:
            tok = tokenizers.Tokenizer.from_str(json.dumps(spec))
        except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception on a bad spec)
            raise ModelDirError(f"{path}: cannot build the tokenizer ({e})") from None
        tcfg = load_tokenizer_config(d)
        return cls(tok, spec, bos_token=tcfg.bos_token, eos_token=tcfg.eos_token, add_bos_token=tcfg.add_bos_token)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no BOS/EOS added; special tokens in the text match as one token."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt: `encode`, after the BOS token where the model's tokenizer adds
        it (add_bos_token) and the text (a rendered chat template, say) does not begin with it."""
        ids = self.encode(text)
        return self._bos_prefix + ids if self._bos_prefix and ids[:1] != self._bos_prefix else ids

    @property
    def add_bos_token(self) -> bool:
        """Whether prompts begin with the BOS token (`encode_prompt`)."""
        return bool(self._bos_prefix)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes `token_id` adds to the output; b"" for ids outside the vocab
        (a model's padded embedding rows)."""
        return self._table[token_id] if 0 <= token_id < len(self._table) else b""

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`. Byte-level: the joined token bytes decoded with errors='replace'."""
        ids = [i for i in ids if not (skip_special_tokens and i in self.special_token_ids)]
        if self._byte_level:
            return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", "replace")
        return str(self._tok.decode(ids, skip_special_tokens=False))

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows (added tokens included); the model's may be larger."""
        return len(self._table)

    @property
    def bos_token(self) -> str | None:
        return self._bos_token

    @property
    def eos_token(self) -> str | None:
        return self._eos_token

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special added tokens, content -> id."""
        return dict(self._special)

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_ids

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)
