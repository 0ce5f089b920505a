"""Chat and completion bodies -> GenSpec: prompts as token ids plus validated sampling settings.

Owns request validation beyond msgspec's ranges: the 422 list of unsupported parameters, the
structured-output constraint a request asks for (response_format or structured_outputs, one),
the served model id (404), the chat template render, a chat request's default max_tokens
(the rest of the context), the wire field a context-length refusal names (the engine
decides whether a request fits, at submit) and the SamplingParams build (its RequestError
becomes a 400 naming the field).
Must not touch the engine thread. Tested through tests/serve/test_serve_app.py.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from serve import errors
from serve.wire import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    NamedToolChoice,
    PromptItem,
    SamplingFields,
)
from tl.core.request import MAX_SEED, ConstraintSpec, RequestError, SamplingParams
from tl.entry.served import ServedModel
from tl.text.reasoning import ThinkSpec
from tl.text.tools import ToolFormat, ToolSpec, tool_grammar

Kind = Literal["chat", "completion", "messages", "responses"]


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
    tool_format: ToolFormat | None = None  # answers are parsed for tool calls in this format
    checks: tuple[ConstraintSpec, ...] = ()  # compiled first, so an error names its own field (a tool's parameters)
    thinking: ThinkSpec | None = None  # a reasoning model's chat: thinking split from the answer, its budget

    @property
    def n(self) -> int:
        return len(self.params)


def check_model(model: str | None, info: ServedModel) -> None:
    if model is not None and model != info.model_id:
        raise errors.model_not_found(model)


def _refuse_unsupported(req: SamplingFields) -> None:
    if isinstance(req, CompletionRequest) and req.tools:
        raise errors.unsupported("tools", "on /v1/completions (use /v1/chat/completions)")
    if isinstance(req, CompletionRequest) and req.tool_choice is not None:
        raise errors.unsupported("tool_choice", "on /v1/completions (use /v1/chat/completions)")
    if req.functions is not None:
        raise errors.unsupported("functions")
    if req.function_call is not None:
        raise errors.unsupported("function_call")


ANY_OBJECT = '{"type":"object"}'


def constraint(req: SamplingFields) -> ConstraintSpec | None:
    """The request's structured-output constraint: OpenAI's response_format (json_object,
    json_schema) or vLLM's structured_outputs (json, regex, choice, grammar, json_object), at
    most one of them; None for text. Compiled later (tl/text/grammar.py), off the event loop."""
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


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the template sees them (as transformers' apply_chat_template gets them): text
    parts joined (any other part is a 422; null content is ""), the developer role as system
    (templates know only system), an assistant's tool_calls with their arguments as a dict
    (empty tool_calls: absent), its replayed thinking as reasoning_content (from either wire
    name; tl/text/chat_template.py gives templates every alias), a tool turn's tool_call_id."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text":
                    raise errors.unsupported(f"messages[{i}].content[{j}].type", f"content part {part.type!r}")
            content = "".join(p.text or "" for p in content)
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                param = f"messages[{i}].tool_calls[{j}].function.arguments"
                try:
                    arguments = json.loads(c.function.arguments)
                except ValueError:
                    raise errors.bad_request(f"{param} is not valid JSON", param) from None
                calls.append(
                    {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": arguments}}
                )
            d["tool_calls"] = calls
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:
            d["reasoning_content"] = reasoning
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def render_chat(
    messages: list[ChatMessage],
    info: ServedModel,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt's token ids. With tools, or a conversation that already called tools, the
    model's tool template renders it (its own, or tl's for a model whose template has none).
    template_kwargs: extra template variables (template_kwargs below)."""
    dicts = message_dicts(messages)
    tooled = tools is not None or any("tool_calls" in d or d["role"] == "tool" for d in dicts)
    template = info.tools.template if tooled and info.tools is not None else info.chat_template
    try:
        text = template.render(
            dicts, add_generation_prompt=add_generation_prompt, tools=tools, **(template_kwargs or {})
        )
    except Exception as e:  # noqa: BLE001 - TemplateError, or raise_exception() inside any template
        raise errors.bad_request(f"The chat template could not render these messages: {e}", "messages") from None
    return info.tokenizer.encode_prompt(text)  # <bos> first where the tokenizer adds it and the template did not


_RENDER_ARGS = ("messages", "tools", "documents", "add_generation_prompt")


def template_kwargs(
    given: dict[str, Any] | None, thinking: bool | None, param: str = "chat_template_kwargs"
) -> dict[str, Any]:
    """The extra chat-template variables of a request: its chat_template_kwargs (the variables
    render sets itself are a 400), and `enable_thinking` from `thinking` (reasoning_effort "none",
    Anthropic's thinking type) unless chat_template_kwargs set it."""
    kw = dict(given or {})
    taken = next((k for k in _RENDER_ARGS if k in kw), None)
    if taken is not None:
        raise errors.bad_request(f"{param} may not set {taken!r} (the request itself gives it)", param)
    if thinking is not None:
        kw.setdefault("enable_thinking", thinking)
    return kw


def think_spec(info: ServedModel, ids: list[int], budget: int | None) -> ThinkSpec | None:
    """A reasoning model's thinking for this prompt (None: the model's answers are not split);
    budget: the request's, else the server's default."""
    if info.reasoning is None:
        return None
    return ThinkSpec.of(info.reasoning, ids, info.thinking_token_budget if budget is None else budget)


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A chat request's tools as the template and the constraint need them."""

    dicts: list[dict[str, Any]] | None  # handed to the template (None: render no tools)
    constraint: ConstraintSpec | None  # the calls' grammar (forced or guarded)
    checks: tuple[ConstraintSpec, ...]  # each tool's parameters schema, compiled on its own
    format: ToolFormat | None  # parse answers for calls (None: tool_choice "none" or no tools)


def tool_request(req: ChatRequest, info: ServedModel) -> ToolRequest:
    """Validate tools / tool_choice / parallel_tool_calls: 400s name the field. "none" renders
    no tools and never parses calls; "auto" (the default with tools) lets the model answer or
    call, "required" and a named tool force calls; all calls follow their tool's schema."""
    tools, choice = req.tools or [], req.tool_choice
    if not tools:
        if choice is not None and choice != "none":
            raise errors.bad_request("tool_choice is only allowed when tools are given", "tool_choice")
        return ToolRequest(None, None, (), None)
    if info.tools is None:
        raise errors.unsupported("tools", "this model has no tool-call format")
    names = [t.function.name for t in tools]
    twice = sorted(n for n, k in Counter(names).items() if k > 1)
    if twice:
        raise errors.bad_request(f"tool names must be unique; {twice[0]!r} appears more than once", "tools")
    named = choice.function.name if isinstance(choice, NamedToolChoice) else ""
    if isinstance(choice, NamedToolChoice) and named not in names:
        raise errors.bad_request(
            f"tool_choice names the function {named!r}, which is not among the tools", "tool_choice"
        )
    if choice == "none":
        return ToolRequest(None, None, (), None)
    specs = [
        ToolSpec(
            t.function.name,
            t.function.description,
            "" if t.function.parameters is None else json.dumps(t.function.parameters),
        )
        for t in tools
    ]
    checks = tuple(
        ConstraintSpec("json", s.parameters, f"tools[{i}].function.parameters")
        for i, s in enumerate(specs)
        if s.parameters
    )
    mode = "named" if named else ("auto" if choice is None else choice)
    parallel = req.parallel_tool_calls is not False
    grammar = tool_grammar(info.tools.format, specs, mode, parallel, named)  # type: ignore[arg-type]  # auto/required/named
    dicts = [msgspec.to_builtins(t) for t in tools]
    return ToolRequest(dicts, ConstraintSpec("grammar", grammar, "tools"), checks, info.tools.format)


def prompt_token_lists(prompt: str | list[PromptItem], info: ServedModel, param: str) -> list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [info.tokenizer.encode_prompt(prompt)]
    if all(isinstance(x, int) for x in prompt):
        return [[x for x in prompt if isinstance(x, int)]]
    if all(isinstance(x, str) for x in prompt):
        return [info.tokenizer.encode_prompt(x) for x in prompt if isinstance(x, str)]
    if all(isinstance(x, list) for x in prompt):
        return [list(x) for x in prompt if isinstance(x, list)]
    raise errors.bad_request(
        f"{param} must be a string, a list of strings, a list of token ids or a list of token-id lists, not a mix",
        param,
    )


def _check_tokens(ids: list[int], info: ServedModel, param: str) -> None:
    if not ids:
        raise errors.bad_request(f"{param} must contain at least one token", param)
    bad = next((t for t in ids if t >= info.vocab_size), None)
    if bad is not None:
        raise errors.bad_request(f"token id {bad} is outside the vocabulary (size {info.vocab_size})", param)


def _logit_bias(raw: dict[str, float] | None, info: ServedModel) -> tuple[tuple[int, float], ...]:
    if not raw:
        return ()
    out = []
    for key, bias in raw.items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < info.vocab_size:
            raise errors.bad_request(f"logit_bias key {key!r} is not a token id of this model", "logit_bias")
        out.append((int(key), float(bias)))
    return tuple(sorted(out))


def _sampling(
    req: SamplingFields, max_tokens: int, logprobs: bool, top_logprobs: int, info: ServedModel, n: int
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


def chat_spec(req: ChatRequest, info: ServedModel) -> GenSpec:
    check_model(req.model, info)
    _refuse_unsupported(req)
    if req.top_logprobs and not req.logprobs:
        raise errors.bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    tools = tool_request(req, info)
    fmt_constraint = constraint(req)
    if tools.constraint is not None and fmt_constraint is not None:
        raise errors.bad_request(
            f"tools (tool_choice {req.tool_choice or 'auto'!r}) and {fmt_constraint.param} both constrain the "
            "output; give only one of them (or tool_choice 'none')",
            fmt_constraint.param.split(".")[0],
        )
    thinking = False if req.reasoning_effort == "none" else None
    ids = render_chat(
        req.messages, info, tools=tools.dicts, template_kwargs=template_kwargs(req.chat_template_kwargs, thinking)
    )
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
        tools.constraint or fmt_constraint,
        tools.format,
        tools.checks,
        think_spec(info, ids, req.thinking_token_budget),
    )


def completion_spec(req: CompletionRequest, info: ServedModel) -> GenSpec:
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
