"""Wire records of the v1 API as msgspec Structs.

Owns: request bodies (unknown fields ignored; ranges declared with Meta so a bad value is a
400 whose `param` msgspec's error path names) and frozen response documents. Fields the
server refuses (tools, echo, ...) are declared so routes can answer 422 naming them.
Streamed events are one Struct per API (AnthropicEvent, ResponsesEvent) whose fields an event
kind does not carry are UNSET (absent on the wire), while a null it does carry is sent.
No logic beyond shapes. Tested through the route tests.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from serve.errors import AnthropicError

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Unit = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepPenalty = Annotated[float, Meta(gt=0.0, le=2.0)]
PosInt = Annotated[int, Meta(ge=1)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
NumChoices = Annotated[int, Meta(ge=1, le=16)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
Stop = str | Annotated[list[str], Meta(max_length=4)]


class ContentPart(Struct):
    type: str
    text: str | None = None


class CallFunction(Struct):
    name: str
    arguments: str  # JSON text, as the API sends it


class ToolCall(Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: CallFunction


class ChatMessage(Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers
    reasoning_content: str | None = None  # an assistant turn's thinking, replayed (vLLM's name)
    reasoning: str | None = None  # the same, under OpenRouter's / newer vLLM's name


class FunctionDef(Struct, kw_only=True, omit_defaults=True):
    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct, kw_only=True, omit_defaults=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Struct):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Struct):
    include_usage: bool | None = None


class JsonSchemaFormat(Struct, kw_only=True):
    """OpenAI's response_format.json_schema: `strict` is accepted; tl always enforces the schema."""

    name: Annotated[str, Meta(min_length=1, max_length=64)]
    schema: dict[str, Any] | None = None  # absent: any JSON value
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Struct, kw_only=True, omit_defaults=True):
    """vLLM's structured_outputs: exactly one constraint."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: Annotated[list[str], Meta(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(Struct, kw_only=True):
    """Sampling fields chat and completions share."""

    model: str
    max_tokens: PosInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Unit | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepPenalty | None = None
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    ignore_eos: bool | None = None
    n: NumChoices | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    functions: Any = None
    function_call: Any = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None


class ChatRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: PosInt | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template
    reasoning_effort: ReasoningEffort | None = None  # "none": enable_thinking false; others change nothing
    thinking_token_budget: Annotated[int, Meta(ge=0)] | None = None  # most thinking tokens, then </think>


PromptItem = str | TokenId | list[TokenId]


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | Annotated[list[PromptItem], Meta(min_length=1)]
    tools: Any = None  # chat only: refused here
    tool_choice: Any = None
    logprobs: TopLogprobs | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class EmbeddingRequest(Struct, kw_only=True):
    model: str
    input: str | Annotated[list[PromptItem], Meta(min_length=1)]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None


class TokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


CachedTokens = Annotated[
    int,
    Meta(
        ge=0,
        description="Prompt tokens whose KV came from the prefix cache for this request (whole KV blocks, "
        "found when the request first ran); 0 when nothing was cached",
    ),
]


class PromptTokensDetails(Struct, frozen=True):
    cached_tokens: CachedTokens


class CompletionTokensDetails(Struct, frozen=True):
    reasoning_tokens: Annotated[
        int, Meta(ge=0, description="Tokens of the thinking, its <think> and </think> markers included")
    ]


class Usage(Struct, frozen=True, omit_defaults=True):
    """Chat Completions' and Completions' usage; prompt_tokens includes the cached ones,
    completion_tokens the reasoning ones (details given for a reasoning model's chat answer)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(Struct, frozen=True):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(Struct, frozen=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct, frozen=True):
    content: list[TokenLogprob]


class FunctionCallOut(Struct, frozen=True):
    name: str
    arguments: str


class ToolCallOut(Struct, frozen=True):
    id: str
    type: str
    function: FunctionCallOut


class AssistantMessage(Struct, frozen=True, omit_defaults=True):
    role: str
    content: str | None  # null when the answer is only tool calls
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking (absent when it did not think)
    reasoning: str | None = None  # the same text, under the other name clients read


class ChatChoice(Struct, frozen=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str


class ChatCompletion(Struct, frozen=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionDelta(Struct, frozen=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Struct, frozen=True, omit_defaults=True):
    """A call's first delta carries index, id, type and the name (arguments ""); the rest only
    index and an arguments fragment."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class Delta(Struct, frozen=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None  # a piece of the thinking (streamed before the content)
    reasoning: str | None = None  # the same piece


class ChunkChoice(Struct, frozen=True):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(Struct, frozen=True, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(Struct, frozen=True):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(Struct, frozen=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(Struct, frozen=True, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class Embedding(Struct, frozen=True):
    object: str
    index: int
    embedding: list[float] | str


class EmbeddingUsage(Struct, frozen=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Struct, frozen=True):
    object: str
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class BackendCard(Struct, frozen=True):
    """tl's extension of the model card: where the engine runs (tl.core.stats.BackendInfo)."""

    platform: str
    device_kind: str
    device_count: int
    tensor_parallel: int
    process_count: int
    dtype: str
    attention_kernel: str
    kv_heads: str
    kv_cache_dtype: str
    matmul_precision: str
    matmul_kernel: str
    native_target: str  # the native CPU kernels' build; "" where none is used
    kernel_choices: list[str]  # each measured step-shape class: its pick and the native/XLA ratio
    weight_pages: str = "default"  # "huge": one mapping advised MADV_HUGEPAGE
    plan: list[str] = []  # the execution plan's decisions, each with its reason
    kv_cache_bytes: int = 0  # the KV cache's memory in its format (kv_cache_dtype)
    kv_capacity_tokens: int = 0  # tokens its blocks hold


class ModelCard(Struct, frozen=True):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int
    backend: BackendCard | None = None


class ModelList(Struct, frozen=True):
    object: str
    data: list[ModelCard]


class TokenizeResponse(Struct, frozen=True):
    tokens: list[int]
    count: int
    max_model_len: int


class RenderResponse(Struct, frozen=True):
    token_ids: list[int]  # the prompt the request would run, as vLLM's render endpoints answer


class DetokenizeResponse(Struct, frozen=True):
    prompt: str


encoder = msgspec.json.Encoder()


class AnthropicBlock(Struct, kw_only=True):
    """A content block: text, tool_use (an assistant's call), tool_result (a call's answer);
    any other type is refused with 422 naming it."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[AnthropicBlock] | None = None
    is_error: bool | None = None
    thinking: str | None = None  # a thinking block replayed
    signature: str | None = None


class AnthropicMessage(Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[AnthropicBlock]


class AnthropicTool(Struct, kw_only=True):
    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicThinking(Struct, kw_only=True):
    """Anthropic's `thinking`: enabled (budget_tokens: most thinking tokens), disabled, or
    adaptive (the model's own choice: no budget)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Meta(ge=0)] | None = None


class MessagesRequest(Struct, kw_only=True):
    model: str
    messages: Annotated[list[AnthropicMessage], Meta(min_length=1)]
    max_tokens: PosInt  # required, as Anthropic requires it
    system: str | list[AnthropicBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    stream: bool | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    metadata: dict[str, Any] | None = None
    thinking: AnthropicThinking | None = None


class CountTokensRequest(Struct, kw_only=True):
    model: str
    messages: Annotated[list[AnthropicMessage], Meta(min_length=1)]
    system: str | list[AnthropicBlock] | None = None
    tools: list[AnthropicTool] | None = None


class AnthropicUsage(Struct, frozen=True):
    """Anthropic's split of the prompt: input_tokens + cache_read_input_tokens +
    cache_creation_input_tokens is the whole prompt. Cache reads are the prefix cache's hits;
    nothing is ever written at a charge (tl caches every computed block by itself), so
    cache_creation_input_tokens is always 0."""

    input_tokens: Annotated[int, Meta(ge=0, description="Prompt tokens not read from the cache")]
    output_tokens: int
    cache_creation_input_tokens: Annotated[int, Meta(ge=0, description="Always 0: tl writes its cache at no charge")]
    cache_read_input_tokens: CachedTokens


class AnthropicTextOut(Struct, frozen=True, tag="text", tag_field="type"):
    text: str


class AnthropicToolUseOut(Struct, frozen=True, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


class AnthropicThinkingOut(Struct, frozen=True, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""  # tl signs nothing; a replayed block is accepted as it comes


AnthropicBlockOut = AnthropicThinkingOut | AnthropicTextOut | AnthropicToolUseOut


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class AnthropicMessageDoc(Struct, frozen=True):
    id: str
    type: str  # "message"
    role: str  # "assistant"
    model: str
    content: list[AnthropicBlockOut]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: AnthropicUsage


class TokenCount(Struct, frozen=True):
    input_tokens: int


class AnthropicDelta(Struct, frozen=True, kw_only=True):
    """What a streamed event adds: a text block's text (type text_delta), a thinking block's
    thinking (thinking_delta), a tool_use block's input JSON (input_json_delta), or, in
    message_delta, why the message ended (no type)."""

    type: Literal["text_delta", "thinking_delta", "input_json_delta"] | UnsetType = UNSET
    text: str | UnsetType = UNSET
    thinking: str | UnsetType = UNSET
    partial_json: str | UnsetType = UNSET
    stop_reason: StopReason | None | UnsetType = UNSET
    stop_sequence: str | None | UnsetType = UNSET


class AnthropicOutputUsage(Struct, frozen=True):
    """message_delta's usage, cumulative as Anthropic sends it: the output tokens so far and the
    prompt's split (as AnthropicUsage's)."""

    output_tokens: int
    input_tokens: Annotated[int, Meta(ge=0, description="Prompt tokens not read from the cache")]
    cache_creation_input_tokens: Annotated[int, Meta(ge=0, description="Always 0: tl writes its cache at no charge")]
    cache_read_input_tokens: CachedTokens


class AnthropicEvent(Struct, frozen=True, kw_only=True):
    """One event of a streamed Messages answer (the `event:` line names its type): message_start
    (message), content_block_start (index, content_block), content_block_delta (index, delta),
    content_block_stop (index), message_delta (delta, usage), message_stop, ping, error."""

    type: str
    message: AnthropicMessageDoc | UnsetType = UNSET
    index: int | UnsetType = UNSET
    content_block: AnthropicBlockOut | UnsetType = UNSET
    delta: AnthropicDelta | UnsetType = UNSET
    usage: AnthropicOutputUsage | UnsetType = UNSET
    error: AnthropicError | UnsetType = UNSET


class ResponsesPart(Struct, kw_only=True):
    """A content part of an input message: input_text / output_text (others are refused with 422)."""

    type: str
    text: str | None = None


class ResponsesItem(Struct, kw_only=True):
    """An input item: a message (type "message" or just a role), a function_call, a
    function_call_output, or a reasoning item (its reasoning_text parts go with the next
    assistant turn); any other type is refused with 422 naming it."""

    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ResponsesPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None
    id: str | None = None
    status: str | None = None
    summary: list[ResponsesPart] | None = None  # a reasoning item replayed


class ResponsesTool(Struct, kw_only=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoice(Struct, kw_only=True):
    type: Literal["function"]
    name: str


class ResponsesTextFormat(Struct, kw_only=True, omit_defaults=True):
    """`text.format` as asked for, and as a response shows it (what was not given left out)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponsesText(Struct, kw_only=True):
    format: ResponsesTextFormat | None = None


class ResponsesReasoning(Struct, kw_only=True):
    """`reasoning`: effort "none" turns thinking off where the template supports it (enable_thinking)."""

    effort: ReasoningEffort | None = None
    summary: str | None = None


class ResponsesRequest(Struct, kw_only=True):
    model: str
    input: str | Annotated[list[ResponsesItem], Meta(min_length=1)]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: PosInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    text: ResponsesText | None = None
    stream: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    user: str | None = None
    reasoning: ResponsesReasoning | None = None


class ResponsesOutputText(Struct, frozen=True, tag="output_text", tag_field="type"):
    """A message item's text part."""

    text: str
    annotations: list[Any] = []  # none are made


class ResponsesMessageItem(Struct, frozen=True, tag="message", tag_field="type"):
    """An output item: the assistant's text (no part while a streamed one is still empty)."""

    id: str
    status: str  # "in_progress" | "completed"
    role: str  # "assistant"
    content: list[ResponsesOutputText]


class ResponsesFunctionCall(Struct, frozen=True, tag="function_call", tag_field="type"):
    """An output item: one call of a function tool (`call_id` is what its output answers)."""

    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: str  # "in_progress" | "completed"


class ResponsesReasoningText(Struct, frozen=True, tag="reasoning_text", tag_field="type"):
    """A reasoning item's content part: the thinking, as the model wrote it."""

    text: str


class ResponsesSummaryText(Struct, frozen=True, tag="summary_text", tag_field="type"):
    text: str


class ResponsesReasoningItem(Struct, frozen=True, tag="reasoning", tag_field="type"):
    """An output item: the model's thinking before its answer (`content`; no summary is made)."""

    id: str
    summary: list[ResponsesSummaryText]
    content: list[ResponsesReasoningText]
    status: str  # "in_progress" | "completed"


ResponsesOutputItem = ResponsesReasoningItem | ResponsesMessageItem | ResponsesFunctionCall


class ResponsesIncomplete(Struct, frozen=True):
    reason: str  # "max_output_tokens"


class ResponsesInputDetails(Struct, frozen=True):
    cached_tokens: CachedTokens


class ResponsesOutputDetails(Struct, frozen=True):
    reasoning_tokens: int


class ResponsesUsage(Struct, frozen=True):
    input_tokens: int
    input_tokens_details: ResponsesInputDetails
    output_tokens: int
    output_tokens_details: ResponsesOutputDetails
    total_tokens: int


class ResponseDoc(Struct, frozen=True):
    """A response object (its `output` items and `usage` as OpenAI's API has them)."""

    id: str
    object: str  # "response"
    created_at: int
    status: str  # "completed" | "incomplete" | "in_progress"
    incomplete_details: ResponsesIncomplete | None
    model: str
    output: list[ResponsesOutputItem]
    usage: ResponsesUsage | None
    instructions: str | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    temperature: float | None
    top_p: float | None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None
    tools: list[ResponsesTool]
    text: ResponsesText
    max_output_tokens: int | None
    previous_response_id: str | None
    store: bool
    error: dict[str, Any] | None = None  # never set: a failed request is an error status or event


class ResponsesEvent(Struct, frozen=True, kw_only=True):
    """One event of a streamed response; every one carries its `sequence_number`: the response
    (response.created, .in_progress, .completed), an output item added or done (output_index,
    item), a content part added or done (item_id, output_index, content_index, part), a text
    or arguments delta or their end (delta, text, arguments), or an error (code, message, param)."""

    type: str
    sequence_number: int
    response: ResponseDoc | UnsetType = UNSET
    item_id: str | UnsetType = UNSET
    output_index: int | UnsetType = UNSET
    item: ResponsesOutputItem | UnsetType = UNSET
    content_index: int | UnsetType = UNSET
    part: ResponsesOutputText | ResponsesReasoningText | UnsetType = UNSET
    delta: str | UnsetType = UNSET
    text: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET
    code: str | None | UnsetType = UNSET
    message: str | UnsetType = UNSET
    param: str | None | UnsetType = UNSET


class DeletedResponse(Struct, frozen=True):
    id: str
    object: str
    deleted: bool
