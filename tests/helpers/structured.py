"""Structured-output cases shared by the engine tests (tests/core/test_structured.py) and the
server's (tests/serve/test_serve_structured.py): CFG and GRAMMARS (the compiler over the byte
tokenizer), grammar (a compiled constraint), SCHEMA (a realistic JSON Schema), nested_any_of (a
schema that compiles slowly), Trimmed (a guide that records the drafts it was offered) and Failing
(a matcher that fails mid-way). Must hold no tests."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tests.helpers.fake_engine import byte_grammars
from tl.core.config import EngineConfig
from tl.core.request import ConstraintSpec, Guide
from tl.text.grammar import Grammar

CFG = EngineConfig(
    model_dir="unused",
    block_size=4,
    num_kv_blocks=128,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    token_buckets=(8, 16, 32, 64),
    seq_buckets=(1, 2, 4, 8),
    max_model_len=256,
    prefill_chunk=16,
    compile_cache_dir="",
)


GRAMMARS = byte_grammars(CFG)


def grammar(kind: str = "json", text: str | None = None) -> Grammar:
    spec = ConstraintSpec(kind, json.dumps(SCHEMA) if text is None else text, "response_format")  # type: ignore[arg-type]
    return GRAMMARS.compile(spec).grammar


SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["red", "green", "blue"]},
        "pts": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
        "sub": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "name": {"type": "string", "maxLength": 6}},
            "required": ["ok", "name"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "tag", "pts", "sub"],
    "additionalProperties": False,
}


def nested_any_of(depth: int) -> dict[str, object]:
    """A schema whose grammar grows exponentially with depth (llguidance: ~1 s at 8 on 2 cores)."""
    s: dict[str, object] = {"type": "integer"}
    for _ in range(depth):
        s = {"anyOf": [{"type": "object", "properties": {"a": s, "b": s}}, {"type": "array", "items": s}]}
    return s


class Trimmed:
    """A guide over a real matcher that records, per call, how many drafts it was offered."""

    def __init__(self, inner: Guide) -> None:
        self.inner = inner
        self.offered: list[tuple[int, int]] = []

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        n = self.inner.valid_prefix(tokens)
        self.offered.append((len(tokens), n))
        return n

    def fill(self, mask: Any, row: int, drafts: Sequence[int]) -> None:
        assert self.inner.valid_prefix(drafts) == len(drafts), "a refused draft reached the step"
        self.inner.fill(mask, row, drafts)

    def accept(self, token: int) -> bool:
        return self.inner.accept(token)

    @property
    def done(self) -> bool:
        return self.inner.done

    @property
    def error(self) -> str:
        return self.inner.error


class Failing:
    """A constraint whose matcher refuses the `after`-th token (a matcher error mid-generation)."""

    def __init__(self, after: int) -> None:
        self.after = after

    def matcher(self) -> Guide:
        g = grammar("regex", "[a-z]*")
        failing = self

        class _Guide(Trimmed):
            n = 0

            def accept(self, token: int) -> bool:
                self.n += 1
                return self.n < failing.after and self.inner.accept(token)

            @property
            def error(self) -> str:
                return "injected"

        return _Guide(g.matcher())
