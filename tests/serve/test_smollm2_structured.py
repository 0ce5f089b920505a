"""Structured output end to end on the real SmolLM2-135M, over real HTTP (granian serving
serve.app:app), with the official openai client: `chat.completions.parse` with a Pydantic model
returns a parsed object; a realistic JSON Schema (nested objects, enums, arrays, bounds)
answers valid, compact JSON (checked by the independent `jsonschema` validator) whenever it
finishes with "stop", and streamed equals non-streamed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.helpers.granian_server import serving_model

pytestmark = pytest.mark.slow


class Landmark(BaseModel):
    name: str = Field(max_length=24)
    kind: Literal["museum", "tower", "church", "park", "palace"]


class City(BaseModel):
    name: str = Field(max_length=20)
    country: Literal["France", "Germany", "Italy", "Spain", "United Kingdom"]
    population_millions: int = Field(ge=0, le=40)
    landmarks: list[Landmark] = Field(max_length=2)


SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 30},
        "genre": {"enum": ["fiction", "science", "history", "poetry"]},
        "year": {"type": "integer", "minimum": 1500, "maximum": 2030},
        "authors": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 24}, "alive": {"type": "boolean"}},
                "required": ["name", "alive"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 2,
        },
    },
    "required": ["title", "genre", "year", "authors"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(smol_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    engine = (
        "block_size = 16\nnum_kv_blocks = 128\nmax_num_seqs = 2\nmax_num_batched_tokens = 256\nprefill_chunk = 256\n"
        "token_buckets = [16, 256]\nseq_buckets = [1, 2]\n"
    )
    with serving_model(smol_dir, tmp_path_factory.mktemp("smol-structured"), engine) as url:
        with openai.OpenAI(base_url=url, api_key="none", max_retries=0) as c:
            yield c


def test_openai_parse_returns_a_pydantic_object(client: openai.OpenAI) -> None:
    done = client.chat.completions.parse(
        model="smol",
        messages=[{"role": "user", "content": "Describe Paris as JSON: its name, country, population and landmarks."}],
        response_format=City,
        temperature=0,
        max_tokens=200,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    city = choice.message.parsed
    assert isinstance(city, City) and city.country in ("France", "Germany", "Italy", "Spain", "United Kingdom")
    assert 0 <= city.population_millions <= 40 and len(city.landmarks) <= 2
    assert "\n" not in (choice.message.content or "")


def test_a_realistic_schema_is_valid_compact_and_streams_the_same(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "book", "schema": SCHEMA, "strict": True}}
    messages: Any = [{"role": "user", "content": "Give me a famous novel as JSON."}]
    base: Any = dict(model="smol", messages=messages, response_format=fmt, max_tokens=200)
    doc = client.chat.completions.create(**base, temperature=0)
    text = doc.choices[0].message.content or ""
    assert doc.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    assert text == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)  # compact
    chunks = list(client.chat.completions.create(**base, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices[0].finish_reason == "stop"
    sampled = client.chat.completions.create(**base, temperature=1.0, top_p=0.9, seed=7, n=2)
    for ch in sampled.choices:
        if ch.finish_reason == "stop":
            jsonschema.validate(json.loads(ch.message.content or ""), SCHEMA)
        else:
            assert ch.finish_reason == "length"


WEATHER_TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "description": "The current time"}},
]


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"]
)
def test_forced_tool_calls_with_the_openai_client(client: openai.OpenAI, choice: Any) -> None:
    """`required` and a named tool on SmolLM2 (tl's tool template, SmolLM2's JSON-array form):
    create() and the client's stream accumulation give the same valid calls."""
    messages: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw: Any = dict(
        model="smol", messages=messages, tools=WEATHER_TOOLS, tool_choice=choice, temperature=0, max_tokens=120
    )
    done = client.chat.completions.create(**kw, parallel_tool_calls=False)
    ch = done.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    calls = ch.message.tool_calls or []
    assert len(calls) == 1 and calls[0].id.startswith("call_")
    fn = calls[0].function  # type: ignore[union-attr]
    if isinstance(choice, dict):
        assert (fn.name, fn.arguments) == ("get_time", "{}")
    else:
        assert fn.name in ("get_weather", "get_time")
        if fn.name == "get_weather":
            jsonschema.validate(json.loads(fn.arguments), WEATHER_TOOLS[0]["function"]["parameters"])
    with client.chat.completions.stream(**kw, parallel_tool_calls=False) as s:
        final = s.get_final_completion()
    streamed = final.choices[0].message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in streamed] == [(fn.name, fn.arguments)]
    assert final.choices[0].finish_reason == "tool_calls"
