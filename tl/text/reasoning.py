"""Reasoning models: the thinking a model writes between `<think>` and `</think>`, kept apart from its answer.

Owns: Markers and `setup` (whether the served model thinks: `[engine] reasoning_parser`, "auto"
detecting it from the chat template or the tokenizer's vocabulary; both markers must be single
tokens), Thinking (the token-level state of one output: before any thinking, inside it, in the
answer; the one rule the guide and usage's reasoning_tokens share), ThinkSpec (one request's:
whether its prompt already opened the thinking, its thinking budget), ThinkingGuide (a Guide of
tl/core/request.py that lets the thinking run free, forces `</think>` once the budget is spent,
and only then hands the tokens to the answer's own constraint, so a JSON schema or a forced tool
call applies to the answer after the thinking), and ReasoningParser (generated text in,
ReasoningText and answer text out: a marker split across pieces is held back, as stop strings
are; the markers themselves are never emitted, the thinking is trimmed of surrounding
whitespace and the answer of the whitespace right after `</think>`).
Pure Python and numpy: must not import jax. Tested by tests/text/test_reasoning.py.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

from tl.core.config import ConfigError
from tl.core.request import Constraint, Guide
from tl.text.pieces import add_text

ReasoningParserName = Literal["auto", "none", "think"]
START, END = "<think>", "</think>"


class TokenIds(Protocol):
    def token_to_id(self, token: str) -> int | None: ...


@dataclass(frozen=True, slots=True)
class Markers:
    """The served model's thinking markers, their text and their (single) token ids."""

    start_id: int
    end_id: int
    start: str = START
    end: str = END


@dataclass(frozen=True, slots=True)
class ReasoningSetup:
    """Whether the served model's output is split into thinking and answer (`markers` None: it
    is not), and why (logged at start-up)."""

    markers: Markers | None
    reason: str


def setup(parser: ReasoningParserName, template_source: str, tokenizer: TokenIds) -> ReasoningSetup:
    """`[engine] reasoning_parser` applied to the model: "none" never splits; "think" always does
    (the markers must be single tokens, else ConfigError); "auto" does when the vocabulary holds
    both markers as single tokens (the reason logged names the chat template when it writes
    `<think>`)."""
    if parser == "none":
        return ReasoningSetup(None, "reasoning: off (reasoning_parser)")
    ids = tokenizer.token_to_id(START), tokenizer.token_to_id(END)
    found = ids[0] is not None and ids[1] is not None
    if parser == "think" and not found:
        raise ConfigError(f"reasoning_parser 'think': {START} and {END} are not single tokens of this tokenizer")
    if parser == "auto" and not found:
        return ReasoningSetup(None, f"reasoning: off ({START} and {END} are not tokens of this vocabulary)")
    assert ids[0] is not None and ids[1] is not None
    markers = Markers(ids[0], ids[1])
    if parser == "think":
        return ReasoningSetup(markers, "reasoning: <think> blocks split from the answer (reasoning_parser)")
    why = "the chat template writes <think>" if START in template_source else "the vocabulary holds <think>"
    return ReasoningSetup(markers, f"reasoning: <think> blocks split from the answer (detected: {why})")


class Phase(enum.Enum):
    MAYBE = "maybe"  # nothing yet: the first token may open the thinking
    THINKING = "thinking"
    ANSWER = "answer"


@dataclass(frozen=True, slots=True)
class Thinking:
    """Where one output stands: its phase and the tokens thought so far (markers not counted)."""

    phase: Phase
    num_thought: int = 0

    def after(self, token: int, markers: Markers) -> Thinking:
        if self.phase is Phase.MAYBE:
            return Thinking(Phase.THINKING) if token == markers.start_id else Thinking(Phase.ANSWER)
        if self.phase is Phase.THINKING:
            return (
                Thinking(Phase.ANSWER) if token == markers.end_id else replace(self, num_thought=self.num_thought + 1)
            )
        return self

    def is_reasoning(self, token: int, markers: Markers) -> bool:
        """Whether `token`, generated now, belongs to the thinking (its markers included)."""
        return self.phase is Phase.THINKING or (self.phase is Phase.MAYBE and token == markers.start_id)


@dataclass(frozen=True, slots=True)
class ThinkSpec:
    """One request's thinking: the markers, whether its prompt opened the thinking (a template
    that ends the prompt with `<think>`), and the most tokens it may think (None: no limit)."""

    markers: Markers
    opened: bool
    budget: int | None = None

    @classmethod
    def of(cls, markers: Markers, prompt_ids: Sequence[int], budget: int | None) -> ThinkSpec:
        """The prompt opened the thinking when its last marker is `<think>`."""
        last = {t: i for i, t in enumerate(prompt_ids) if t in (markers.start_id, markers.end_id)}
        opened = last.get(markers.start_id, -1) > last.get(markers.end_id, -1)
        return cls(markers, opened, budget)

    def initial(self) -> Thinking:
        return Thinking(Phase.THINKING if self.opened else Phase.MAYBE)

    def parser(self) -> ReasoningParser:
        return ReasoningParser(self.markers, self.opened)

    def constraint(self, answer: Constraint | None) -> Constraint | None:
        """What the request's tokens must follow: `answer` (the answer's own constraint) after the
        thinking, and the budget's forced `</think>`; None when neither applies."""
        if answer is None and self.budget is None:
            return None
        return ThinkingConstraint(self, answer)


@dataclass(frozen=True, slots=True)
class ThinkingConstraint:
    """A Constraint (tl/core/request.py): one ThinkingGuide per sequence."""

    spec: ThinkSpec
    answer: Constraint | None

    def matcher(self) -> ThinkingGuide:
        return ThinkingGuide(self.spec, None if self.answer is None else self.answer.matcher())


class ThinkingGuide:
    """A Guide: free tokens while thinking (only `</think>` once the budget is spent), then the
    answer's guide (none: free). Before anything, `<think>` or what the answer's guide allows."""

    def __init__(self, spec: ThinkSpec, answer: Guide | None) -> None:
        self._spec, self._answer = spec, answer
        self._state = spec.initial()
        self._error = ""

    def _allows(self, state: Thinking, token: int) -> bool:
        m = self._spec.markers
        if state.phase is Phase.THINKING:
            return not self._spent(state) or token == m.end_id
        if token == m.start_id or self._answer is None:  # MAYBE
            return True
        return self._answer.valid_prefix([token]) == 1

    def _spent(self, state: Thinking) -> bool:
        budget = self._spec.budget
        return budget is not None and state.num_thought >= budget

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        state = self._state
        for k, t in enumerate(tokens):
            if state.phase is Phase.ANSWER or (state.phase is Phase.MAYBE and t != self._spec.markers.start_id):
                rest = len(tokens) - k if self._answer is None else self._answer.valid_prefix(tokens[k:])
                return k + rest  # the answer from this token on
            if not self._allows(state, t):
                return k
            state = state.after(t, self._spec.markers)
        return len(tokens)

    def fill(self, mask: Any, row: int, drafts: Sequence[int]) -> None:
        state, m = self._state, self._spec.markers
        for k in range(len(drafts) + 1):
            if state.phase is Phase.ANSWER:
                if self._answer is None:
                    mask[row + k : row + len(drafts) + 1] = -1
                else:
                    self._answer.fill(mask, row + k, drafts[k:])
                return
            if state.phase is Phase.THINKING and self._spent(state):
                mask[row + k] = 0
                _allow(mask, row + k, m.end_id)
            elif state.phase is Phase.THINKING or self._answer is None:
                mask[row + k] = -1
            else:  # MAYBE under the answer's constraint: it, or <think>
                answering = k < len(drafts) and drafts[k] != m.start_id  # the rest of the drafts are answer
                self._answer.fill(mask, row + k, drafts[k:] if answering else ())
                _allow(mask, row + k, m.start_id)
                if answering:
                    return
            if k < len(drafts):
                state = state.after(drafts[k], m)

    def accept(self, token: int) -> bool:
        state, m = self._state, self._spec.markers
        if state.phase is Phase.ANSWER:
            return True if self._answer is None else self._answer.accept(token)
        if not self._allows(state, token):
            why = f"not {m.end} after the thinking budget" if state.phase is Phase.THINKING else "refused"
            self._error = f"token {token} {why}"
            return False
        self._state = state.after(token, m)
        if self._state.phase is Phase.ANSWER and state.phase is Phase.MAYBE and self._answer is not None:
            return self._answer.accept(token)  # the answer's first token
        return True

    @property
    def done(self) -> bool:
        return self._state.phase is Phase.ANSWER and self._answer is not None and self._answer.done

    @property
    def error(self) -> str:
        return self._error or (self._answer.error if self._answer is not None else "")


def _allow(mask: Any, row: int, token: int) -> None:
    word, bit = divmod(token, 32)
    mask[row, word] |= (1 << bit) if bit < 31 else -(1 << 31)  # int32 words: bit 31 is the sign


@dataclass(frozen=True, slots=True)
class ReasoningText:
    """A piece of the thinking (what the parser emits beside answer text, a plain str)."""

    text: str


_WS = " \t\r\n"


class ReasoningParser:
    """Generated text -> ReasoningText and answer text, one character at a time. `push` text as it
    becomes safe to show, `finish` at the end. Opened: the text starts inside the thinking;
    otherwise it is thinking only if it starts with `<think>`. Text after `</think>` is answer."""

    def __init__(self, markers: Markers, opened: bool) -> None:
        self._m = markers
        self._phase = Phase.THINKING if opened else Phase.MAYBE
        self._held = ""  # a possible marker start (or, thinking, trailing whitespace)
        self._said = False  # thinking text emitted yet (its leading whitespace is dropped)
        self._trim = False  # just after </think>: whitespace is dropped

    def push(self, text: str) -> list[ReasoningText | str]:
        out: list[ReasoningText | str] = []
        for c in text:
            if self._phase is Phase.MAYBE:
                self._maybe_char(c, out)
            elif self._phase is Phase.THINKING:
                self._thinking_char(c, out)
            elif not (self._trim and c in _WS):
                self._trim = False
                add_text(out, c)
        return out

    def finish(self) -> list[ReasoningText | str]:
        out: list[ReasoningText | str] = []
        if self._phase is Phase.MAYBE:
            add_text(out, self._held)
        elif self._phase is Phase.THINKING:
            _think(out, self._held.rstrip(_WS))
        self._held = ""
        return out

    def _maybe_char(self, c: str, out: list[ReasoningText | str]) -> None:
        self._held += c
        if self._held == self._m.start:
            self._phase, self._held = Phase.THINKING, ""
        elif not self._m.start.startswith(self._held):
            self._phase = Phase.ANSWER
            add_text(out, self._held)
            self._held = ""

    def _thinking_char(self, c: str, out: list[ReasoningText | str]) -> None:
        if not self._said and not self._held and c in _WS:
            return
        self._held += c
        end = self._m.end
        if self._held.endswith(end):
            _think(out, self._held[: -len(end)].rstrip(_WS))
            self._phase, self._held, self._trim = Phase.ANSWER, "", True
            return
        # keep a suffix that may still become the end marker, and whitespace before it (trimmed
        # if the marker follows); emit the rest
        keep = next((n for n in range(min(len(end) - 1, len(self._held)), 0, -1) if end.startswith(self._held[-n:])), 0)
        body = self._held[: len(self._held) - keep]
        cut = len(body.rstrip(_WS))
        if cut:
            _think(out, body[:cut])
            self._said = True
            self._held = self._held[cut:]


def _think(out: list[ReasoningText | str], text: str) -> None:
    if not text:
        return
    if out and isinstance(out[-1], ReasoningText):
        out[-1] = ReasoningText(out[-1].text + text)
    else:
        out.append(ReasoningText(text))
