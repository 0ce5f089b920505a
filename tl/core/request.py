"""Request records that cross the engine's public seam: what a caller submits and what a step returns.

Owns: SamplingParams (validated per-request sampling settings), GenRequest, EmbedRequest, TokenOut,
FinishReason, ConstraintSpec (a structured-output constraint as the wire gave it), the two
protocols a compiled one is used through (Constraint, Guide: tl/text/grammar.py implements them,
the scheduler and runner call them), the compiler AsyncEngine compiles one with
(ConstraintCompiler, its result Compiled; tl/text/grammar.py implements it), the typed
admission errors and the two admission rules (`check_context`, `check_capacity`) with their
messages; the engine applies them with its own limits
(tl/core/engine.py), serve/ turns the errors into HTTP answers (serve/errors.py). Pure data: must
not import jax, the runner or the scheduler. The mutable per-request state the scheduler
keeps lives in tl/core/sequence.py, not here. Tested through tests/core/test_engine.py,
tests/core/test_async_engine.py and the 400s and 429s of tests/serve/test_serve_app.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

FinishReason = Literal["stop", "length", "abort", "no_capacity", "error"]
"""stop: EOS, a stop token id or a complete constrained answer; length: max_tokens or the
context limit; abort: abort() was called; no_capacity: still waiting for KV blocks after
queue_deadline_ms; error: the constraint's matcher refused a token (TokenOut.error says why)."""
ConstraintKind = Literal["json", "regex", "choice", "grammar"]

MAX_SEED = 2**63 - 1
MAX_EMBED_INPUTS = 2048
"""Most inputs one embeddings request may carry (OpenAI's limit for an input array)."""


class RequestError(ValueError):
    """A request the engine cannot accept; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class QueueFullError(RequestError):
    """The waiting queue is at queue_capacity: the server answers 429."""


class ContextLengthError(RequestError):
    """Prompt plus max_tokens exceed the context: the server answers 400 context_length_exceeded."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens. Defaults are the OpenAI API's."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None  # None: the engine picks one
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        def bad(param: str, msg: str) -> RequestError:
            return RequestError(f"{param} {msg}", param=param)

        if not 0.0 <= self.temperature <= 2.0:
            raise bad("temperature", f"must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad("top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise bad("seed", f"must be in [0, 2**63 - 1], got {self.seed}")
        if self.max_tokens < 1:
            raise bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not 0 <= self.top_logprobs <= 20:
            raise bad("top_logprobs", f"must be in [0, 20], got {self.top_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        for tok, bias in self.logit_bias:
            if not -100.0 <= bias <= 100.0:
                raise bad("logit_bias", f"values must be in [-100, 100], got {bias} for token {tok}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
        )


@dataclass(frozen=True, slots=True)
class ConstraintSpec:
    """What a request's output must match, as the wire gave it (tl/text/grammar.py compiles it).

    kind "json": `text` is a JSON Schema document; "regex": a regular expression; "choice": a
    JSON array of strings, one of which is the whole output; "grammar": a Lark grammar.
    `param` is the wire field it came from, named by every error about it.
    """

    kind: ConstraintKind
    text: str
    param: str


class Guide(Protocol):
    """One sequence's matcher (tl.text.grammar.Matcher): the scheduler trims drafts to what it allows
    and feeds it every token; the runner fills the step's bitmask rows from it."""

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of the tokens, in order, the grammar allows from here."""
        ...

    def fill(self, mask: Any, row: int, drafts: Sequence[int]) -> None:
        """Bitmask rows row .. row+len(drafts) of an int32 [R, W] array: now, and after each draft."""
        ...

    def accept(self, token: int) -> bool:
        """Consume a sampled token; False puts the matcher in its error state."""
        ...

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but EOS may follow."""
        ...

    @property
    def error(self) -> str: ...


class Constraint(Protocol):
    """A compiled constraint (tl.text.grammar.Grammar): a fresh matcher per sequence."""

    def matcher(self) -> Guide: ...


@dataclass(frozen=True, slots=True)
class Compiled:
    """What one compile request got: the constraint, whether the cache had it, and the seconds spent."""

    grammar: Constraint
    cached: bool
    seconds: float


class ConstraintCompiler(Protocol):
    """What compiles structured output's constraints (tl.text.grammar.GrammarCompiler): thread-safe,
    AsyncEngine runs it on worker threads and bounds each compile by timeout_s."""

    @property
    def timeout_s(self) -> float: ...

    def compile(self, spec: ConstraintSpec) -> Compiled:
        """spec compiled (or from the cache); raises RequestError naming spec.param when it does not."""
        ...

    def refuse(self, spec: ConstraintSpec) -> None:
        """Remember spec as too slow while its compile still runs (AsyncEngine gave up on it)."""
        ...

    def too_slow(self, spec: ConstraintSpec) -> RequestError:
        """The refusal of a constraint whose compile overran timeout_s."""
        ...

    def tokenizer(self) -> object:
        """Build what compiling needs of the tokenizer (once; AsyncEngine.start warms it)."""
        ...


@dataclass(frozen=True, slots=True)
class GenRequest:
    """One generation: prompt token ids plus how to sample. Priority -100..100, higher first.
    `constraint`: the grammar its output must match (each request gets its own matcher)."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise RequestError("prompt must contain at least one token", param="prompt")
        if not -100 <= self.priority <= 100:
            raise RequestError(f"priority must be in [-100, 100], got {self.priority}", param="priority")


@dataclass(frozen=True, slots=True)
class EmbedRequest:
    """One embeddings request: its inputs (token ids each), pooled in any order and in any steps.

    Each input becomes a sequence of its own in the scheduler (prompt work, chunked like any
    prompt); the request counts once against the queue capacity.
    """

    inputs: tuple[tuple[int, ...], ...]
    priority: int = 0

    def __post_init__(self) -> None:
        if not 1 <= len(self.inputs) <= MAX_EMBED_INPUTS:
            raise RequestError(f"input must hold 1 to {MAX_EMBED_INPUTS} inputs, got {len(self.inputs)}", param="input")
        for i, ids in enumerate(self.inputs):
            if not ids:
                raise RequestError(f"input[{i}] is empty", param="input")
        if not -100 <= self.priority <= 100:
            raise RequestError(f"priority must be in [-100, 100], got {self.priority}", param="priority")


@dataclass(frozen=True, slots=True)
class TokenOut:
    """One token a step produced for a request (a step may produce several per request).

    A finished request with no new token (abort, no_capacity, error) has token_id -1; so has a
    finished embeddings input, whose `embedding` is its mean-pooled, L2-normalised vector.
    `error` says why a request finished with "error".

    `num_cached_tokens`: how many of the request's prompt tokens had their KV read from the prefix
    cache rather than computed, counted once, when the scheduler first admitted the request
    (whole blocks; at most the prompt minus one token). A recompute after preemption does not
    change it: usage reports what the request's prompt found cached when it first ran, not the
    engine's later bookkeeping. Every TokenOut of the request carries the same count (0 for an
    embeddings input, never looked up). The engine's totals over all admissions, recomputes
    included, are EngineStats.prefix_cache_hits and prefix_cache_queries.

    `scheduled_s`: the engine's clock (time.monotonic unless the Engine was handed another) when
    the scheduler first admitted the request into a step, taken with num_cached_tokens; every
    TokenOut of a token (or of a matcher's error) carries it: where the request's queue wait ends
    and its prefill starts (serve/tracing.py's spans). 0.0 on the others (abort, no_capacity) and
    for a request never scheduled.
    """

    request_id: int
    token_id: int
    logprob: float = 0.0
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish_reason: FinishReason | None = None
    embedding: tuple[float, ...] = ()
    error: str = ""
    num_cached_tokens: int = 0
    scheduled_s: float = 0.0


def check_context(req: GenRequest | EmbedRequest, max_model_len: int) -> None:
    """The context-length rule of admission: a generation's prompt plus max_tokens, and each
    embeddings input alone, fit max_model_len tokens. Raises ContextLengthError naming the counts
    (`param`: "max_tokens" for a generation, "input" for an embeddings input)."""
    if isinstance(req, GenRequest):
        num_prompt, max_tokens = len(req.prompt_ids), req.params.max_tokens
        if num_prompt + max_tokens > max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the "
                "completion (max_tokens)). Reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return
    for i, ids in enumerate(req.inputs):
        if len(ids) > max_model_len:
            raise ContextLengthError(
                f"input[{i}] has {len(ids)} tokens; this model's maximum context length is {max_model_len} tokens",
                param="input",
                code="context_length_exceeded",
            )


def check_capacity(num_waiting: int, queue_capacity: int) -> None:
    """The queue rule of admission: one more request is refused when num_waiting requests (an
    embeddings request counts once) already wait. Raises QueueFullError."""
    if num_waiting >= queue_capacity:
        raise QueueFullError(
            f"the admission queue is full ({queue_capacity} requests waiting)", code="rate_limit_exceeded"
        )
