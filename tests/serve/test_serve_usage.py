"""Prompt-cache hits in usage, in every API, with the official clients over real HTTP.

granian serves tests/helpers/fake_app.py: the real Engine (scheduler, block manager, radix prefix
cache) over the succ runner, 4-token KV blocks (tests/helpers/granian_server.py's `server`). Each API
gets its own first character, so its prompts share no block with another API's: a first
request finds nothing cached (0), and a second one sharing SHARED prompt tokens with it
reports the whole blocks of that prefix, exactly. Chat Completions and Completions
(`prompt_tokens_details.cached_tokens`, streamed in the include_usage chunk, and n > 1
counting a prompt once), the Responses API (`input_tokens_details.cached_tokens`) and
Anthropic's Messages API (`cache_read_input_tokens`, with `input_tokens` the rest, in the
message, message_start and message_delta); /metrics' prefix-cache hits count the same hits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import openai

from serve.openapi import document
from tests.helpers.granian_server import server

BLOCK_SIZE = 4  # the server's block_size (granian_server.server)
SHARED = 14  # prompt tokens the second request of a pair shares with the first
HIT = BLOCK_SIZE * (SHARED // BLOCK_SIZE)  # the whole blocks of the shared prefix: 12


def pair(tag: str) -> tuple[str, str]:
    """Two prompts (one byte a token) sharing SHARED tokens, then differing; `tag` (their first
    block's first token) keeps them apart from every other pair's. The first's cached blocks
    hold its prompt and output (succ's "yz{" after "x"), which the second's fourth block
    ("mnQR") does not match."""
    shared = (tag + "bcdefghijklmnop")[:SHARED]
    return shared + "x", shared + "QRS"


def chat(text: str) -> Any:
    return [{"role": "user", "content": text}]  # the succ template: the contents, nothing added


def test_cached_prompt_tokens_in_every_api(tmp_path: Path) -> None:
    with (
        server(tmp_path) as srv,
        openai.OpenAI(base_url=f"{srv.api}/v1", api_key="x", max_retries=0) as oa,
        anthropic.Anthropic(base_url=srv.api, api_key="x", max_retries=0) as an,
    ):
        hits = 0  # every admission's prefix-cache hit, as /metrics counts them

        # Chat Completions: non-streamed, then streamed with include_usage
        first, second = pair("C")
        r = oa.chat.completions.create(model="succ", messages=chat(first), max_tokens=3, temperature=0)
        assert r.usage is not None and r.usage.prompt_tokens == len(first)
        assert r.usage.prompt_tokens_details is not None and r.usage.prompt_tokens_details.cached_tokens == 0
        chunks = list(
            oa.chat.completions.create(
                model="succ",
                messages=chat(second),
                max_tokens=3,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens == len(second)
        assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == HIT
        hits += HIT

        # n = 2: both choices hit (the engine counts both), usage counts the prompt once
        first, second = pair("N")
        oa.chat.completions.create(model="succ", messages=chat(first), max_tokens=1, temperature=0)
        r = oa.chat.completions.create(model="succ", messages=chat(second), max_tokens=2, n=2, temperature=0)
        assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(second), 4)
        assert r.usage.prompt_tokens_details is not None and r.usage.prompt_tokens_details.cached_tokens == HIT
        hits += 2 * HIT

        # Completions: streamed with include_usage, then non-streamed
        first, second = pair("P")
        pieces = list(
            oa.completions.create(
                model="succ",
                prompt=first,
                max_tokens=3,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        usage = pieces[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        assert (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens) == (len(first), 0)
        c = oa.completions.create(model="succ", prompt=second, max_tokens=3, temperature=0)
        assert c.usage is not None and c.usage.prompt_tokens_details is not None
        assert (c.usage.prompt_tokens, c.usage.prompt_tokens_details.cached_tokens) == (len(second), HIT)
        hits += HIT

        # Responses: created, then streamed
        first, second = pair("R")
        resp = oa.responses.create(model="succ", input=first, max_output_tokens=3, temperature=0)
        assert resp.usage is not None and resp.usage.input_tokens_details.cached_tokens == 0
        assert resp.usage.output_tokens_details.reasoning_tokens == 0
        with oa.responses.stream(model="succ", input=second, max_output_tokens=3, temperature=0) as s:
            final = s.get_final_response()
        assert final.usage is not None and final.usage.input_tokens == len(second)
        assert final.usage.input_tokens_details.cached_tokens == HIT
        hits += HIT

        # Anthropic Messages: input_tokens + cache_read_input_tokens + cache_creation_input_tokens = the prompt
        first, second = pair("A")
        msg = an.messages.create(model="succ", max_tokens=3, extra_body={"temperature": 0}, messages=chat(first))
        u = msg.usage
        assert (u.input_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens) == (len(first), 0, 0)
        with an.messages.stream(
            model="succ",
            max_tokens=3,
            extra_body={"temperature": 0},
            messages=chat(second),
        ) as ms:
            events = list(ms)
            final_msg = ms.get_final_message()
        start = events[0]
        assert start.type == "message_start"
        assert (start.message.usage.input_tokens, start.message.usage.cache_read_input_tokens) == (
            len(second) - HIT,
            HIT,
        )
        delta = next(e for e in events if e.type == "message_delta")
        assert delta.usage.cache_read_input_tokens == HIT and delta.usage.output_tokens == 3
        u = final_msg.usage
        assert (u.input_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens) == (len(second) - HIT, HIT, 0)
        assert u.output_tokens == 3
        hits += HIT

        assert srv.metric("tl_engine_prefix_cache_hits_total") == hits


def test_the_openapi_document_describes_the_cache_fields() -> None:
    schemas = document("succ")["components"]["schemas"]
    assert "prompt_tokens_details" in schemas["Usage"]["required"]
    assert schemas["PromptTokensDetails"]["required"] == ["cached_tokens"]
    assert schemas["ResponsesInputDetails"]["properties"]["cached_tokens"]["description"].startswith("Prompt tokens")
    for name in ("AnthropicUsage", "AnthropicOutputUsage"):
        assert {"cache_read_input_tokens", "cache_creation_input_tokens"} <= set(schemas[name]["required"])
