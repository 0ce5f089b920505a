"""Chat and completion bodies -> GenSpec: prompts as token ids plus validated sampling settings.

Owns request validation beyond msgspec's ranges: the 422 list of unsupported parameters, the
structured-output constraint a request asks for (response_format or structured_outputs, one),
the served model id (404), the chat template render, a chat request's default max_tokens
(the rest of the context), the wire field a context-length refusal names (the engine
decides whether a request fits, at submit) and the SamplingParams build (its RequestError
becomes a 400 naming the field).
Must not touch the engine thread. Tested through tests/test_serve_app.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from serve import errors
from serve.wire import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    PromptItem,
    SamplingFields,
)
from tl.request import MAX_SEED, ConstraintSpec, RequestError, SamplingParams
from tl.stats import BackendInfo

Kind = Literal["chat", "completion"]


class TokenizerLike(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...


class TemplateLike(Protocol):
    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str: ...


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What validation needs to know about the served model."""

    model_id: str
    max_model_len: int
    max_logprobs: int
    vocab_size: int
    tokenizer: TokenizerLike
    template: TemplateLike
    backend: BackendInfo | None = None  # where the engine runs (None for fake engines)


@dataclass(frozen=True, slots=True)
class GenSpec:
    kind: Kind
    prompts: tuple[tuple[int, ...], ...]  # one per prompt; each gets n choices
    params: tuple[SamplingParams, ...]  # one per choice of a prompt (seeds differ when n > 1)
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: bool
    context_param: str  # the field a context-length refusal names: max_tokens' own, or "messages" when defaulted
    constraint: ConstraintSpec | None = None  # structured output: what every choice must match

    @property
    def n(self) -> int:
        return len(self.params)


def check_model(model: str | None, info: ModelInfo) -> None:
    if model is not None and model != info.model_id:
        raise errors.model_not_found(model)


def _refuse_unsupported(req: SamplingFields) -> None:
    if req.tools:
        raise errors.unsupported("tools")
    if req.tool_choice not in (None, "none"):
        raise errors.unsupported("tool_choice")
    if req.functions is not None:
        raise errors.unsupported("functions")
    if req.function_call is not None:
        raise errors.unsupported("function_call")


ANY_OBJECT = '{"type":"object"}'


def constraint(req: SamplingFields) -> ConstraintSpec | None:
    """The request's structured-output constraint: OpenAI's response_format (json_object,
    json_schema) or vLLM's structured_outputs (json, regex, choice, grammar, json_object), at
    most one of them; None for text. Compiled later (tl/grammar.py), off the event loop."""
    specs = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        specs.append(ConstraintSpec("json", ANY_OBJECT, "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise errors.bad_request(
                "response_format.json_schema is required when type is 'json_schema'", "response_format.json_schema"
            )
        schema = rf.json_schema.schema
        text = "{}" if schema is None else json.dumps(schema)
        specs.append(ConstraintSpec("json", text, "response_format.json_schema.schema"))
    so = req.structured_outputs
    if so is not None:
        given = [
            (name, value)
            for name, value in (
                ("json", so.json),
                ("regex", so.regex),
                ("choice", so.choice),
                ("grammar", so.grammar),
                ("json_object", so.json_object or None),
            )
            if value is not None
        ]
        if len(given) != 1:
            names = ", ".join(f"structured_outputs.{n}" for n, _ in given) or "none"
            raise errors.bad_request(
                f"structured_outputs must hold exactly one of json, regex, choice, grammar, json_object (got {names})",
                "structured_outputs",
            )
        name, value = given[0]
        param = f"structured_outputs.{name}"
        if name == "json":
            specs.append(ConstraintSpec("json", value if isinstance(value, str) else json.dumps(value), param))
        elif name == "json_object":
            specs.append(ConstraintSpec("json", ANY_OBJECT, param))
        elif name == "choice":
            specs.append(ConstraintSpec("choice", json.dumps(value), param))
        elif name == "regex" or name == "grammar":
            if not value:
                raise errors.bad_request(f"{param} must not be empty", param)
            specs.append(ConstraintSpec("regex" if name == "regex" else "grammar", str(value), param))
    if len(specs) > 1:
        raise errors.bad_request(
            f"{specs[0].param} and {specs[1].param} both constrain the output; give only one of them",
            specs[1].param.split(".")[0],
        )
    return specs[0] if specs else None


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the template sees them; text parts are joined, any other part is a 422."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text":
                    raise errors.unsupported(f"messages[{i}].content[{j}].type", f"content part {part.type!r}")
            content = "".join(p.text or "" for p in content)
        d = {"role": m.role, "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def render_chat(messages: list[ChatMessage], info: ModelInfo, add_generation_prompt: bool = True) -> list[int]:
    dicts = message_dicts(messages)
    try:
        text = info.template.render(dicts, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # noqa: BLE001 - TemplateError, or raise_exception() inside any template
        raise errors.bad_request(f"The chat template could not render these messages: {e}", "messages") from None
    return info.tokenizer.encode(text)


def prompt_token_lists(prompt: str | list[PromptItem], info: ModelInfo, param: str) -> list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [info.tokenizer.encode(prompt)]
    if all(isinstance(x, int) for x in prompt):
        return [[x for x in prompt if isinstance(x, int)]]
    if all(isinstance(x, str) for x in prompt):
        return [info.tokenizer.encode(x) for x in prompt if isinstance(x, str)]
    if all(isinstance(x, list) for x in prompt):
        return [list(x) for x in prompt if isinstance(x, list)]
    raise errors.bad_request(
        f"{param} must be a string, a list of strings, a list of token ids or a list of token-id lists, not a mix",
        param,
    )


def _check_tokens(ids: list[int], info: ModelInfo, param: str) -> None:
    if not ids:
        raise errors.bad_request(f"{param} must contain at least one token", param)
    bad = next((t for t in ids if t >= info.vocab_size), None)
    if bad is not None:
        raise errors.bad_request(f"token id {bad} is outside the vocabulary (size {info.vocab_size})", param)


def _logit_bias(raw: dict[str, float] | None, info: ModelInfo) -> tuple[tuple[int, float], ...]:
    if not raw:
        return ()
    out = []
    for key, bias in raw.items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < info.vocab_size:
            raise errors.bad_request(f"logit_bias key {key!r} is not a token id of this model", "logit_bias")
        out.append((int(key), float(bias)))
    return tuple(sorted(out))


def _sampling(
    req: SamplingFields, max_tokens: int, logprobs: bool, top_logprobs: int, info: ModelInfo, n: int
) -> tuple[SamplingParams, ...]:
    if top_logprobs > info.max_logprobs:
        raise errors.bad_request(
            f"top_logprobs must be <= {info.max_logprobs}, got {top_logprobs}",
            "top_logprobs" if isinstance(req, ChatRequest) else "logprobs",
        )
    base_seed = None if req.seed is None else req.seed % (MAX_SEED + 1)
    out = []
    for i in range(n):
        try:
            out.append(
                SamplingParams(
                    temperature=1.0 if req.temperature is None else req.temperature,
                    top_p=1.0 if req.top_p is None else req.top_p,
                    top_k=max(req.top_k or 0, 0),
                    min_p=req.min_p or 0.0,
                    seed=None if base_seed is None else (base_seed + i) % (MAX_SEED + 1),
                    max_tokens=max_tokens,
                    stop_token_ids=tuple(req.stop_token_ids or ()),
                    ignore_eos=bool(req.ignore_eos),
                    logprobs=logprobs,
                    top_logprobs=top_logprobs,
                    presence_penalty=req.presence_penalty or 0.0,
                    frequency_penalty=req.frequency_penalty or 0.0,
                    repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                    logit_bias=_logit_bias(req.logit_bias, info),
                )
            )
        except RequestError as e:
            raise errors.from_request_error(e) from None
    return tuple(out)


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not s for s in stops):
        raise errors.bad_request("stop strings must not be empty", "stop")
    return stops


def chat_spec(req: ChatRequest, info: ModelInfo) -> GenSpec:
    check_model(req.model, info)
    _refuse_unsupported(req)
    if req.top_logprobs and not req.logprobs:
        raise errors.bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    ids = render_chat(req.messages, info)
    _check_tokens(ids, info, "messages")
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    # Not asked: the rest of the context, at least one token (the engine refuses what does not fit).
    max_tokens = asked if asked is not None else max(info.max_model_len - len(ids), 1)
    params = _sampling(req, max_tokens, bool(req.logprobs), req.top_logprobs or 0, info, req.n or 1)
    return GenSpec(
        "chat",
        (tuple(ids),),
        params,
        _stops(req.stop),
        bool(req.stream),
        bool(req.stream_options and req.stream_options.include_usage),
        bool(req.logprobs),
        "messages" if asked is None else param,
        constraint(req),
    )


def completion_spec(req: CompletionRequest, info: ModelInfo) -> GenSpec:
    check_model(req.model, info)
    _refuse_unsupported(req)
    if req.echo:
        raise errors.unsupported("echo")
    if req.suffix:
        raise errors.unsupported("suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise errors.unsupported("best_of")
    prompts = prompt_token_lists(req.prompt, info, "prompt")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    for ids in prompts:
        _check_tokens(ids, info, "prompt")
    logprobs = req.logprobs is not None
    params = _sampling(req, max_tokens, logprobs, req.logprobs or 0, info, req.n or 1)
    return GenSpec(
        "completion",
        tuple(tuple(p) for p in prompts),
        params,
        _stops(req.stop),
        bool(req.stream),
        bool(req.stream_options and req.stream_options.include_usage),
        logprobs,
        "max_tokens",
        constraint(req),
    )
