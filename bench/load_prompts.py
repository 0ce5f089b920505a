"""Prompts sized to an exact token count with the model's own tokenizer.

Owns: loading `tokenizer.json` from a model dir (the `tokenizers` package, no tl needed so a
peer's model dir works) and building text whose re-encoded length is exactly N tokens, made
of seeded random common words and starting with a caller-given head (a unique nonce, or
nothing for shared prefixes). Counts are without special tokens: a server that adds BOS, or
a chat template, adds its own tokens; the usage chunk reports what the server counted.
Tested by tests/bench/test_bench_harness.py (byte tokenizer and an in-test trained BPE).
"""

from __future__ import annotations

import random
import secrets
from pathlib import Path

from tokenizers import Tokenizer

WORDS = (
    "the of and to in is it that was for on are with as his they be at one have this from or had by hot word "
    "but what some we can out other were all there when up use your how said an each she which do their time "
    "if will way about many then them write would like so these her long make thing see him two has look more "
    "day could go come did number sound no most people my over know water than call first who may down side "
    "been now find any new work part take get place made live where after back little only round man year came "
    "show every good me give our under name very through just form sentence great think say help low line"
).split()
# Appended one at a time to close the last few tokens; each is one token in common BPEs.
_FILLERS = (" a", " I", ".", ",", " the", "a", " ")


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def count_tokens(tok: Tokenizer, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False).ids)


def sized_text(tok: Tokenizer, num_tokens: int, rng: random.Random, head: str = "") -> str:
    """Text starting with `head` that encodes to exactly `num_tokens` tokens (verified)."""
    base = count_tokens(tok, head)
    if base > num_tokens:
        raise ValueError(f"head {head!r} alone is {base} tokens, more than the {num_tokens} asked for")
    words: list[str] = []
    n = base
    while n < num_tokens:  # grow in batches: about one token per common word
        words += [rng.choice(WORDS) for _ in range(max(1, num_tokens - n))]
        n = count_tokens(tok, _join(head, words))
    while n > num_tokens and words:
        words.pop()
        n = count_tokens(tok, _join(head, words))
    text = _join(head, words)
    while n < num_tokens:
        text, n = _close_gap(tok, text, n, num_tokens)
    if count_tokens(tok, text) != num_tokens:  # pragma: no cover - guarded by _close_gap
        raise AssertionError("sized_text: re-encoding changed the count")
    return text


def _join(head: str, words: list[str]) -> str:
    if not words:
        return head
    return head + ("" if not head or head.endswith((" ", "\n")) else " ") + " ".join(words)


def _close_gap(tok: Tokenizer, text: str, n: int, target: int) -> tuple[str, int]:
    for piece in _FILLERS:
        m = count_tokens(tok, text + piece)
        if n < m <= target:
            return text + piece, m
    raise ValueError(f"cannot reach exactly {target} tokens from {n} with this tokenizer")


class PromptFactory:
    """Seeded prompts; every unique prompt opens with a nonce unique to this run (no accidental
    prefix hits).

    The nonce's number is drawn from the seed and `run_id`, fresh per run unless given: with the
    seed alone, a second run against a live server sent the very prompts of the first and found them in its prefix
    cache (sweep c=64: 518.7 against 374.1 out tok/s cold). Pass the printed run id to replay
    a run's prompts exactly.
    """

    def __init__(self, tok: Tokenizer, seed: int, run_id: str | None = None) -> None:
        self.tok = tok
        self.rng = random.Random(seed)
        self.seed = seed
        self.run_id = run_id if run_id is not None else secrets.token_hex(4)
        self._nonce_rng = random.Random(f"{seed}/{self.run_id}")
        self._counter = 0

    def nonce(self, tag: str) -> str:
        self._counter += 1
        return f"[{tag} {self._counter} {self._nonce_rng.getrandbits(32):08x}] "

    def unique(self, num_tokens: int, tag: str = "req") -> str:
        return sized_text(self.tok, num_tokens, self.rng, head=self.nonce(tag))

    def shared(self, num_tokens: int, tag: str = "system") -> str:
        """A system prompt: its own nonce first (so each run starts cold), ends with a newline."""
        return sized_text(self.tok, num_tokens - 1, self.rng, head=self.nonce(tag)) + "\n"
