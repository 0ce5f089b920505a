"""Structured output: constraints compiled to llguidance grammars, and one matcher per sequence.

Owns: turning a ConstraintSpec (tl/core/request.py) into llguidance grammar text (JSON Schema with
compact whitespace, regex, a choice of strings, Lark), the llguidance tokenizer built from the
model's tokenizer.json (its vocabulary padded to the model's, so mask columns past the
tokenizer's tokens stay blocked), compiling with resource limits, the LRU cache of compiled
grammars keyed by the exact spec (a refusal is cached too, a too slow one as soon as its caller
gives up), the time bound, Matcher: one
sequence's llguidance matcher behind tl.core.request's Guide (the scheduler trims drafts and
consumes tokens through it), and `fill_masks`, a step's bitmask rows filled in parallel. Host code (numpy,
llguidance): must not import jax. The async time bound is AsyncEngine's (it runs `compile` on
its worker threads). Tested by tests/text/test_grammar.py.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import llguidance
import numpy as np

from tl.core.request import Compiled, ConstraintSpec, Guide, RequestError

JSON_OPTIONS: dict[str, str | bool] = {
    "whitespace_flexible": False,  # compact: "," and ":" only, so no runaway newlines until max_tokens
    "item_separator": ",",
    "key_separator": ":",
}
"""Overrides for every JSON grammar (a schema's own x-guidance cannot loosen the whitespace)."""

_LIMITS = dict(max_grammar_size=200_000, max_lexer_states=100_000)
"""llguidance's resource limits at compile time (defaults 500k / 250k): a schema past them is a
400, not minutes of CPU."""


class GrammarError(RequestError):
    """A constraint that does not compile (or not in time): a 400 naming its wire field."""


def too_slow(spec: ConstraintSpec, timeout_s: float) -> GrammarError:
    """The refusal of a constraint whose compile took longer than grammar_timeout_s."""
    return GrammarError(
        f"{spec.param}: compiling this constraint took longer than {timeout_s:g} s (grammar_timeout_s); simplify it",
        param=spec.param,
    )


def grammar_text(spec: ConstraintSpec) -> str:
    """The llguidance grammar of a spec (not yet checked: `GrammarCompiler.compile` checks)."""
    try:
        if spec.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.text, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.text)
        if spec.kind == "choice":
            choices = json.loads(spec.text)
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        return llguidance.LLMatcher.grammar_from_lark(spec.text)
    except ValueError as e:  # not a JSON object where one is needed
        raise GrammarError(f"{spec.param}: {e}", param=spec.param) from None


class Matcher:
    """One sequence's position in its grammar (tl.core.request.Guide). Rows of the bitmask hold one
    bit per model token id, 1 = allowed; `fill` leaves the matcher where it found it."""

    __slots__ = ("_m",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        return int(self._m.validate_tokens(list(tokens)))

    def fill(self, mask: np.ndarray, row: int, drafts: Sequence[int]) -> None:
        """Rows row .. row+len(drafts) of mask [R, W] int32: the allowed tokens now, and after each
        draft in turn (the drafts were trimmed to the valid prefix; consumed, then rolled back)."""
        width = mask.shape[1] * 4
        done = 0
        for j in range(len(drafts) + 1):
            self._m.unsafe_compute_mask_ptr(mask[row + j].ctypes.data, width)
            if j < len(drafts):
                if not self._m.consume_token(drafts[j]):
                    raise RuntimeError(f"draft {drafts[j]} refused after validation: {self._m.get_error()}")
                done += 1
        if done:
            self._m.rollback(done)

    def accept(self, token: int) -> bool:
        return bool(self._m.consume_token(token))

    @property
    def done(self) -> bool:
        """The grammar is complete and allows no more tokens but EOS (or the EOS was consumed)."""
        return bool(self._m.is_stopped()) and not self._m.is_error()

    @property
    def error(self) -> str:
        return str(self._m.get_error())


@cache
def _executor() -> llguidance.LLExecutor:
    """llguidance's thread pool for a step's masks: one thread per core (the step has not started
    yet, so the cores are free), not its default of 80% of them."""
    return llguidance.LLExecutor(num_threads=max(1, len(os.sched_getaffinity(0))))


def fill_masks(mask: np.ndarray, rows: Sequence[tuple[Guide, int, Sequence[int]]]) -> None:
    """Every constrained row of a step's bitmask [R, W] int32 at once: each (guide, first row,
    drafts) fills rows first .. first+len(drafts). Matchers of this module are filled in
    parallel by llguidance's executor (it consumes the drafts and rolls them back itself); any
    other Guide (a test's) through its own `fill`."""
    plain = [(g._m, row) for g, row, drafts in rows if isinstance(g, Matcher) and not drafts]
    drafted = [(g._m, row, list(drafts)) for g, row, drafts in rows if isinstance(g, Matcher) and drafts]
    if (plain or drafted) and (not mask.flags["C_CONTIGUOUS"] or mask.dtype != np.int32):
        raise ValueError("the bitmask must be a C-contiguous int32 array")
    width, batch = mask.shape[1] * 4, mask.shape[0]
    if plain:
        _executor().unsafe_compute_mask_ptr(plain, mask.ctypes.data, width, batch)
    if drafted:  # llguidance's call for drafts refuses an empty draft list: the two batches apart
        _executor().unsafe_compute_mask_ptr_with_draft_token(drafted, mask.ctypes.data, width, batch)
    for g, row, drafts in rows:
        if not isinstance(g, Matcher):
            g.fill(mask, row, drafts)


@dataclass(frozen=True, slots=True)
class Grammar:
    """A compiled grammar (tl.core.request.Constraint): each `matcher()` is a fresh copy at its start."""

    spec: ConstraintSpec
    _proto: llguidance.LLMatcher

    def matcher(self) -> Matcher:
        return Matcher(self._proto.deep_copy())


class GrammarCompiler:
    """Compiles ConstraintSpecs against one model's tokenizer (tl.core.request.ConstraintCompiler);
    thread-safe (AsyncEngine runs it on worker threads; llguidance drops the GIL while it builds
    a grammar)."""

    def __init__(
        self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int, timeout_s: float
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self.cache_size = cache_size
        self.timeout_s = timeout_s
        self._tok: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._tok_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Grammar | GrammarError] = OrderedDict()

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int, timeout_s: float
    ) -> GrammarCompiler:
        text = (Path(model_dir) / "tokenizer.json").read_text()
        return cls(text, vocab_size, eos_token_ids, cache_size, timeout_s)

    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer (~0.4 s to build for a 49k vocabulary; once)."""
        with self._tok_lock:
            if self._tok is None:
                tok = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos or None)
                if tok.vocab_size != self.vocab_size:
                    raise ValueError(f"tokenizer has {tok.vocab_size} tokens, the model {self.vocab_size}")
                self._tok = tok
            return self._tok

    @property
    def mask_words(self) -> int:
        """int32 words in one bitmask row."""
        return (self.vocab_size + 31) // 32

    def compile(self, spec: ConstraintSpec) -> Compiled:
        """The grammar of spec, from the cache or compiled now; raises GrammarError with the
        library's reason (a compile slower than timeout_s is refused, and stays refused)."""
        key = (spec.kind, spec.text)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if isinstance(hit, GrammarError):
            raise GrammarError(str(hit), param=spec.param)
        if hit is not None:
            return Compiled(hit, True, 0.0)
        t0 = time.perf_counter()
        outcome: Grammar | GrammarError
        try:
            outcome = self._build(spec)
        except GrammarError as e:
            outcome = e
        seconds = time.perf_counter() - t0
        if seconds > self.timeout_s:
            outcome = too_slow(spec, self.timeout_s)
        self._remember(spec, outcome)
        if isinstance(outcome, GrammarError):
            raise outcome
        return Compiled(outcome, False, seconds)

    def too_slow(self, spec: ConstraintSpec) -> GrammarError:
        """The refusal of spec when its compile overran timeout_s (AsyncEngine's bound)."""
        return too_slow(spec, self.timeout_s)

    def refuse(self, spec: ConstraintSpec) -> None:
        """Remember spec as too slow now, while its compile still runs (AsyncEngine gave up on
        it); that compile's own outcome replaces this when it returns."""
        self._remember(spec, too_slow(spec, self.timeout_s))

    def _remember(self, spec: ConstraintSpec, outcome: Grammar | GrammarError) -> None:
        with self._lock:
            self._cache[(spec.kind, spec.text)] = outcome
            self._cache.move_to_end((spec.kind, spec.text))
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def _build(self, spec: ConstraintSpec) -> Grammar:
        text = grammar_text(spec)
        limits = llguidance.LLParserLimits(**_LIMITS)  # type: ignore[arg-type]  # ints, as declared
        m = llguidance.LLMatcher(self.tokenizer(), text, log_level=0, limits=limits)
        if m.is_error():
            raise GrammarError(f"{spec.param}: {_reason(m.get_error())}", param=spec.param)
        return Grammar(spec, m)


def _reason(message: str) -> str:
    """llguidance's error without its wrapper prefix (kept short for an HTTP answer)."""
    message = message.strip()
    for prefix in ("Grammar error: ", "grammar error: "):
        message = message.removeprefix(prefix)
    return message[:2000]
