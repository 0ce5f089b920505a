"""The /v1 route handlers: chat, completions, embeddings, tokenize, detokenize, models.

Owns decoding each body into its wire Struct (msgspec errors -> 400 with param), and the
documents of the non-generation routes. Generation itself lives in serve/generate.py, its
shapes in each dialect's Presenter (serve/chat.py, serve/anthropic.py, serve/responses.py).
Handlers get a Ctx (engine, metrics, request, sender, watcher) and either send a response
or raise ApiError before sending anything. Tested through tests/serve/test_serve_app.py.
"""

from __future__ import annotations

import base64
import math
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from serve import errors
from serve.anthropic import MessagesPresenter, count_tokens, messages_spec
from serve.asgi import DisconnectWatcher, Request, Sender
from serve.chat import ChatPresenter, CompletionPresenter
from serve.generate import Job, Presenter, respond
from serve.metrics import Metrics
from serve.params import (
    GenSpec,
    chat_spec,
    check_model,
    completion_spec,
    prompt_token_lists,
    render_chat,
    template_kwargs,
)
from serve.responses import ResponsesPresenter, ResponseStore, conversation, responses_spec
from serve.wire import (
    AnthropicEvent,
    AnthropicMessageDoc,
    BackendCard,
    ChatCompletion,
    ChatCompletionChunk,
    ChatRequest,
    Completion,
    CompletionRequest,
    CountTokensRequest,
    DeletedResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    Embedding,
    EmbeddingList,
    EmbeddingRequest,
    EmbeddingUsage,
    MessagesRequest,
    ModelCard,
    ModelList,
    RenderResponse,
    ResponseDoc,
    ResponsesEvent,
    ResponsesRequest,
    TokenCount,
    TokenizeRequest,
    TokenizeResponse,
    encoder,
)
from tl.core.async_engine import AsyncEngine, EmbedHandle, EngineError
from tl.core.request import MAX_EMBED_INPUTS, Constraint, ConstraintSpec, EmbedRequest, RequestError
from tl.entry.served import ServedModel

if TYPE_CHECKING:
    from serve.otel import RequestTrace

S = TypeVar("S")
STARTED_AT = int(time.time())


@dataclass
class Ctx:
    engine: AsyncEngine
    info: ServedModel
    metrics: Metrics
    request: Request
    out: Sender
    body: bytes
    arrived: float
    ping_interval_s: Callable[[], float]
    jobs: set[Job | EmbedHandle]  # in flight, aborted at the drain deadline
    store: ResponseStore  # the Responses API's stored responses (per replica)
    watcher: DisconnectWatcher | None = None
    trace: RequestTrace | None = None  # tracing on: the request's spans (serve/otel.py)


_DECODERS: dict[type, msgspec.json.Decoder[Any]] = {
    t: msgspec.json.Decoder(t)
    for t in (
        ChatRequest,
        CompletionRequest,
        EmbeddingRequest,
        TokenizeRequest,
        DetokenizeRequest,
        MessagesRequest,
        CountTokensRequest,
        ResponsesRequest,
    )
}


def decode(body: bytes, typ: type[S]) -> S:
    try:
        return _DECODERS[typ].decode(body)  # type: ignore[no-any-return]  # the decoder made for typ
    except msgspec.DecodeError as e:
        raise errors.from_decode_error(e) from None


def priority(ctx: Ctx) -> int:
    raw = ctx.request.headers.get("x-tl-priority")
    if raw is None:
        return 0
    try:
        value = int(raw.strip())
    except ValueError:
        value = 1000
    if not -100 <= value <= 100:
        raise errors.bad_request(f"X-TL-Priority must be an integer in [-100, 100], got {raw!r}", "X-TL-Priority")
    return value


async def _generate(ctx: Ctx, spec_fn: Callable[[], GenSpec], present: Presenter) -> None:
    if "x-tl-kv-handle" in ctx.request.headers:
        raise errors.ApiError(
            404,
            "KV handles are not served by this engine (no disaggregated prefill)",
            "invalid_request_error",
            "X-TL-KV-Handle",
            "kv_handle_not_found",
        )
    spec = spec_fn()
    prio = priority(ctx)
    for check in spec.checks:  # a tool's parameters alone first: its error names its own field
        await _compile(ctx, check, count=False)
    grammar = await _compile(ctx, spec.constraint) if spec.constraint is not None else None
    job = Job(spec, ctx.engine, ctx.info, prio, ctx.metrics, ctx.arrived, grammar, present.id_prefix)
    ctx.jobs.add(job)
    if ctx.trace is not None:
        ctx.trace.job(job)
    try:
        assert ctx.watcher is not None
        await respond(job, ctx.out, ctx.watcher, ctx.ping_interval_s, present)
    finally:
        ctx.jobs.discard(job)


async def _compile(ctx: Ctx, spec: ConstraintSpec, count: bool = True) -> Constraint:
    """The request's constraint compiled (a 400 naming its field if it does not compile in time);
    `count`: it is the request's constraint (a tool's parameters checked alone are not)."""
    m = ctx.metrics
    try:
        compiled = await ctx.engine.compile_constraint(spec)
    except RequestError as e:
        if count:
            m.grammar_requests.labels(spec.kind, "refused").inc()
        raise errors.from_request_error(e) from None
    if count:
        m.grammar_requests.labels(spec.kind, "cached" if compiled.cached else "compiled").inc()
    if not compiled.cached:
        m.grammar_compile.observe(compiled.seconds)
    return compiled.grammar


async def chat(ctx: Ctx) -> None:
    req = decode(ctx.body, ChatRequest)
    await _generate(ctx, lambda: chat_spec(req, ctx.info), ChatPresenter())


async def completions(ctx: Ctx) -> None:
    req = decode(ctx.body, CompletionRequest)
    await _generate(ctx, lambda: completion_spec(req, ctx.info), CompletionPresenter())


def _pack(vec: list[float], fmt: str | None) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
    return vec


async def embeddings(ctx: Ctx) -> None:
    req = decode(ctx.body, EmbeddingRequest)
    check_model(req.model, ctx.info)
    if req.dimensions is not None:
        raise errors.unsupported("dimensions")
    if (
        isinstance(req.input, list)
        and len(req.input) > MAX_EMBED_INPUTS
        and not all(isinstance(x, int) for x in req.input)
    ):
        raise errors.bad_request(
            f"input holds {len(req.input)} inputs; at most {MAX_EMBED_INPUTS} are allowed", "input"
        )
    inputs = prompt_token_lists(req.input, ctx.info, "input")
    try:
        request = EmbedRequest(tuple(tuple(x) for x in inputs), priority(ctx))  # counts, empty inputs
        ctx.engine.check_context(request)  # the engine's rule, before the vocabulary: too long says so
    except RequestError as e:
        raise errors.from_request_error(e) from None
    for i, ids in enumerate(inputs):
        bad = next((t for t in ids if not 0 <= t < ctx.info.vocab_size), None)
        if bad is not None:
            raise errors.bad_request(
                f"input[{i}]: token id {bad} is outside the vocabulary (size {ctx.info.vocab_size})", "input"
            )
    try:
        handle = ctx.engine.submit_embedding(request)
    except RequestError as e:
        raise errors.from_request_error(e) from None
    except EngineError as e:
        raise errors.from_engine_error(e) from None
    assert ctx.watcher is not None
    ctx.watcher.on_gone(handle.abort)
    ctx.jobs.add(handle)
    try:
        vectors = await handle.vectors()
    except RequestError as e:
        raise errors.from_request_error(e) from None
    except EngineError as e:
        if ctx.watcher.gone.is_set():
            return  # the client left: nobody to answer
        raise (errors.aborted() if handle.aborted else errors.from_engine_error(e)) from None
    finally:
        handle.abort()
        ctx.jobs.discard(handle)
    data = [Embedding("embedding", i, _pack([float(x) for x in v], req.encoding_format)) for i, v in enumerate(vectors)]
    if any(isinstance(v, list) and not all(math.isfinite(x) for x in v) for v in (d.embedding for d in data)):
        raise errors.internal("the model produced a non-finite embedding")
    n = sum(len(x) for x in inputs)
    await ctx.out.whole(200, encoder.encode(EmbeddingList("list", data, ctx.info.model_id, EmbeddingUsage(n, n))))


async def tokenize(ctx: Ctx) -> None:
    req = decode(ctx.body, TokenizeRequest)
    check_model(req.model, ctx.info)
    if (req.prompt is None) == (req.messages is None):
        raise errors.bad_request("give exactly one of prompt or messages", "prompt")
    if req.messages is not None:
        kw = template_kwargs(req.chat_template_kwargs, None)
        ids = render_chat(req.messages, ctx.info, req.add_generation_prompt, template_kwargs=kw)
    else:
        ids = ctx.info.tokenizer.encode_prompt(req.prompt or "")
    await ctx.out.whole(200, encoder.encode(TokenizeResponse(ids, len(ids), ctx.info.max_model_len)))


async def chat_render(ctx: Ctx) -> None:
    """The token ids a chat request would run (vllm-router's kv_aware asks before it routes)."""
    spec = chat_spec(decode(ctx.body, ChatRequest), ctx.info)
    await ctx.out.whole(200, encoder.encode(RenderResponse(list(spec.prompts[0]))))


async def completions_render(ctx: Ctx) -> None:
    """The token ids of a completions request's (first) prompt."""
    spec = completion_spec(decode(ctx.body, CompletionRequest), ctx.info)
    await ctx.out.whole(200, encoder.encode(RenderResponse(list(spec.prompts[0]))))


async def detokenize(ctx: Ctx) -> None:
    req = decode(ctx.body, DetokenizeRequest)
    check_model(req.model, ctx.info)
    if any(t >= ctx.info.vocab_size for t in req.tokens):
        raise errors.bad_request(f"token ids must be < {ctx.info.vocab_size}", "tokens")
    await ctx.out.whole(200, encoder.encode(DetokenizeResponse(ctx.info.tokenizer.decode(req.tokens))))


def _card(ctx: Ctx) -> ModelCard:
    b = ctx.engine.backend_info
    card = (
        None
        if b is None
        else BackendCard(
            b.platform,
            b.device_kind,
            b.device_count,
            b.tensor_parallel,
            b.process_count,
            b.dtype,
            b.attention_kernel,
            b.kv_heads,
            b.kv_cache_dtype,
            b.matmul_precision,
            b.matmul_kernel,
            b.native_target,
            list(b.kernel_choices),
            b.weight_pages,
            list(b.reasons),
            b.kv_cache_bytes,
            b.kv_capacity_tokens,
        )
    )
    return ModelCard(ctx.info.model_id, "model", STARTED_AT, "tl", ctx.info.max_model_len, card)


async def models(ctx: Ctx) -> None:
    await ctx.out.whole(200, encoder.encode(ModelList("list", [_card(ctx)])))


async def model(ctx: Ctx) -> None:
    name = ctx.request.path[len("/v1/models/") :]
    check_model(name, ctx.info)
    await ctx.out.whole(200, encoder.encode(_card(ctx)))


async def responses_create(ctx: Ctx) -> None:
    req = decode(ctx.body, ResponsesRequest)
    check_model(req.model, ctx.info)
    turns = conversation(req, ctx.store)
    present = ResponsesPresenter(req, ctx.store, turns)
    await _generate(ctx, lambda: responses_spec(req, ctx.info, turns), present)


def _response_id(ctx: Ctx) -> str:
    return ctx.request.path[len("/v1/responses/") :]


async def responses_get(ctx: Ctx) -> None:
    await ctx.out.whole(200, encoder.encode(ctx.store.get(_response_id(ctx)).doc))


async def responses_delete(ctx: Ctx) -> None:
    rid = _response_id(ctx)
    ctx.store.delete(rid)
    await ctx.out.whole(200, encoder.encode(DeletedResponse(rid, "response", True)))


Handler = Callable[[Ctx], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Route:
    """One route of the API port: what it takes and answers (serve/openapi.py documents it from this)."""

    method: str
    handler: Handler
    request: type | None  # the body's wire Struct; None: no body
    response: type  # the 200 document's Struct
    summary: str
    chunk: type | None = None  # `stream: true` answers text/event-stream of these documents
    anthropic: bool = False  # errors in Anthropic's shape (the Messages API)


async def messages(ctx: Ctx) -> None:
    req = decode(ctx.body, MessagesRequest)
    await _generate(ctx, lambda: messages_spec(req, ctx.info), MessagesPresenter())


async def messages_count_tokens(ctx: Ctx) -> None:
    req = decode(ctx.body, CountTokensRequest)
    check_model(req.model, ctx.info)
    await ctx.out.whole(200, encoder.encode(TokenCount(count_tokens(req, ctx.info))))


async def openapi(ctx: Ctx) -> None:
    from serve.openapi import document  # the document is built from ROUTES, which this module defines

    await ctx.out.whole(200, encoder.encode(document(ctx.info.model_id)))


_ONE: dict[str, Route] = {
    "/v1/chat/completions": Route(
        "POST", chat, ChatRequest, ChatCompletion, "A chat completion (tools, structured output)", ChatCompletionChunk
    ),
    "/v1/completions": Route("POST", completions, CompletionRequest, Completion, "A text completion", Completion),
    "/v1/chat/completions/render": Route(
        "POST", chat_render, ChatRequest, RenderResponse, "The prompt's token ids a chat request would run"
    ),
    "/v1/completions/render": Route(
        "POST", completions_render, CompletionRequest, RenderResponse, "The first prompt's token ids"
    ),
    "/v1/embeddings": Route("POST", embeddings, EmbeddingRequest, EmbeddingList, "Embeddings of the inputs"),
    "/v1/tokenize": Route("POST", tokenize, TokenizeRequest, TokenizeResponse, "Token ids of a prompt or chat"),
    "/v1/detokenize": Route("POST", detokenize, DetokenizeRequest, DetokenizeResponse, "Text of token ids"),
    "/v1/models": Route("GET", models, None, ModelList, "The served model"),
    "/v1/models/{id}": Route("GET", model, None, ModelCard, "One model by id"),
    "/v1/messages": Route(
        "POST", messages, MessagesRequest, AnthropicMessageDoc, "Anthropic's Messages API", AnthropicEvent, True
    ),
    "/v1/messages/count_tokens": Route(
        "POST", messages_count_tokens, CountTokensRequest, TokenCount, "Input tokens of a Messages request", None, True
    ),
    "/openapi.json": Route("GET", openapi, None, dict, "This document (OpenAPI 3.1)"),
}
ROUTES: dict[str, tuple[Route, ...]] = {
    **{path: (route,) for path, route in _ONE.items()},
    "/v1/responses": (
        Route("POST", responses_create, ResponsesRequest, ResponseDoc, "OpenAI's Responses API", ResponsesEvent),
    ),
    "/v1/responses/{id}": (
        Route("GET", responses_get, None, ResponseDoc, "A stored response"),
        Route("DELETE", responses_delete, None, DeletedResponse, "Delete a stored response"),
    ),
}
"""Every route of the API port but /healthz (answered by serve/app.py before dispatch): the
operations of each path, one per method."""


ALIASES = {"/tokenize": "/v1/tokenize", "/detokenize": "/v1/detokenize"}
"""Paths vLLM serves outside /v1 (vllm-router asks workers to tokenize there): the same operations,
counted under their own label, left out of the OpenAPI document."""


def match(path: str) -> tuple[str, tuple[Route, ...]] | None:
    """(endpoint label, its operations) for a path, or None."""
    if path in ALIASES:
        return path, ROUTES[ALIASES[path]]
    if path in ROUTES and "{" not in path:
        return path, ROUTES[path]
    for prefix in ("/v1/models/", "/v1/responses/"):
        if path.startswith(prefix) and len(path) > len(prefix) and "/" not in path[len(prefix) :]:
            return prefix + "{id}", ROUTES[prefix + "{id}"]
    return None
