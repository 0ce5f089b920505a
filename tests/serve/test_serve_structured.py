"""Structured output through the ASGI app, over the fake engine and the real Engine with the
succ runner (both follow the grammar: the successor byte where it is allowed, else the smallest
allowed byte, so every answer is hand-checkable): each wire form of a constraint, stream ==
non-stream, n choices, the 400s that name the field and the library's reason, two constraints
at once, the compile time bound with a plain request served meanwhile, a matcher failing
mid-way (an error event, never "stop"), and the metrics."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import jsonschema
import pytest

from serve.app import App
from tests.helpers.asgi_client import call
from tests.helpers.fake_engine import SuccRunner, byte_model
from tests.helpers.serve_app import CHAT, chat, content, make_app, metric, run
from tests.helpers.structured import SCHEMA, Failing, nested_any_of
from tl.core.async_engine import AsyncEngine
from tl.core.config import EngineConfig
from tl.core.engine import Engine
from tl.core.request import ConstraintSpec
from tl.entry.served import ServedModel
from tl.text.grammar import Compiled, GrammarCompiler

COMPLETIONS = "/v1/completions"


def schema_format(schema: object = SCHEMA) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}


def answer(doc: dict[str, Any], i: int = 0) -> str:
    ch = doc["choices"][i]
    return str(ch["message"]["content"] if "message" in ch else ch["text"])


def test_each_wire_form_constrains_the_answer(kind: str) -> None:
    async def body(app: App) -> None:
        r = await call(app, "POST", CHAT, chat(response_format=schema_format(), max_tokens=200))
        doc = r.json()
        assert doc["choices"][0]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(answer(doc)), SCHEMA)
        assert " " not in answer(doc)  # compact
        r = await call(app, "POST", CHAT, chat(response_format={"type": "json_object"}, max_tokens=12))
        assert answer(r.json()).startswith("{") and r.json()["choices"][0]["finish_reason"] == "length"
        for so, want in (
            ({"regex": "[a-c]{5}"}, "bcabc"),  # from "a": b, c, then the smallest allowed
            ({"choice": ["xyz", "bca", "q"]}, "bca"),
            ({"grammar": 'start: "q" /[0-9]{3}/ "!"'}, "q012!"),
            (
                {
                    "json": {
                        "type": "object",
                        "properties": {"k": {"const": 7}},
                        "required": ["k"],
                        "additionalProperties": False,
                    }
                },
                '{"k":7}',
            ),
            ({"json": '{"enum": ["a", "b"]}'}, '"a"'),
            ({"json_object": True}, None),
        ):
            for path, req in ((CHAT, chat(structured_outputs=so, max_tokens=8)), (COMPLETIONS, None)):
                req = req or {
                    "model": "succ",
                    "prompt": "a",
                    "max_tokens": 8,
                    "temperature": 0,
                    "structured_outputs": so,
                }
                doc = (await call(app, "POST", path, req)).json()
                if want is not None:
                    assert (answer(doc), doc["choices"][0]["finish_reason"]) == (want, "stop"), (so, doc)

    run(make_app(kind), body)


def test_stream_n_and_seeds_under_a_constraint(kind: str) -> None:
    async def body(app: App) -> None:
        req = chat(response_format=schema_format(), max_tokens=200, n=3, temperature=1.0, seed=11)
        doc = (await call(app, "POST", CHAT, req)).json()
        for i in range(3):
            assert doc["choices"][i]["finish_reason"] == "stop"
            jsonschema.validate(json.loads(answer(doc, i)), SCHEMA)
        assert len({answer(doc, i) for i in range(3)}) > 1  # each choice its own matcher and seed
        single = chat(response_format=schema_format(), max_tokens=200)
        streamed = await call(app, "POST", CHAT, {**single, "stream": True})
        assert content(streamed) == answer((await call(app, "POST", CHAT, single)).json())
        last = json.loads(streamed.events()[-2])
        assert last["choices"][0]["finish_reason"] == "stop"

    run(make_app(kind), body)


def test_stop_strings_logprobs_and_penalties_keep_working(kind: str) -> None:
    async def body(app: App) -> None:
        so = {"regex": "[a-c]{5}"}  # "bcabc" from "a"
        doc = (await call(app, "POST", CHAT, chat(structured_outputs=so, max_tokens=8, stop=["ca"]))).json()
        assert (answer(doc), doc["choices"][0]["finish_reason"]) == ("b", "stop")  # the stop string you set cuts
        doc = (await call(app, "POST", CHAT, chat(structured_outputs=so, max_tokens=8, logprobs=True))).json()
        assert [t["token"] for t in doc["choices"][0]["logprobs"]["content"]] == list("bcabc")
        doc = (await call(app, "POST", CHAT, chat(structured_outputs=so, max_tokens=8, presence_penalty=1.0))).json()
        assert answer(doc) == "bcabc"

    run(make_app(kind), body)


BAD = [
    (chat(response_format=schema_format({"type": "strin"})), "response_format.json_schema.schema", "Invalid type"),
    (
        chat(response_format=schema_format({"type": "array", "uniqueItems": True})),
        "response_format.json_schema.schema",
        "Unimplemented keys",
    ),
    (chat(structured_outputs={"regex": "a(b"}), "structured_outputs.regex", "unclosed group"),
    (chat(structured_outputs={"grammar": "start: foo"}), "structured_outputs.grammar", "unknown name"),
    (chat(structured_outputs={"json": "{nope"}), "structured_outputs.json", ""),
    (chat(structured_outputs={"regex": ""}), "structured_outputs.regex", "empty"),
    (chat(structured_outputs={"choice": []}), "structured_outputs.choice", ""),
    (chat(structured_outputs={}), "structured_outputs", "exactly one"),
    (chat(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs", "structured_outputs.choice"),
    (
        chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
        "structured_outputs",
        "response_format and structured_outputs.regex both constrain",
    ),
]


def test_bad_constraints_are_400s_naming_the_field_and_the_reason(kind: str) -> None:
    async def body(app: App) -> None:
        for req, param, reason in BAD:
            r = await call(app, "POST", CHAT, req)
            assert r.status == 400, (req, r.body)
            err = r.error()
            assert err["type"] == "invalid_request_error" and err["param"] == param, (req, err)
            assert reason in err["message"], (req, err)
        assert app.engine is not None and app.engine.stats().kv_blocks_used == 0
        r = await call(app, "POST", CHAT, chat(structured_outputs={"regex": "[a-z]{3}"}))
        assert r.status == 200 and answer(r.json()) == "bcd"  # still serving

    run(make_app(kind), body)


def test_a_slow_compile_is_a_400_while_plain_requests_are_served() -> None:
    """A schema whose grammar takes ~1 s to build against a 0.3 s bound: 400, and a plain
    request sent meanwhile is answered before it (the compile runs on a worker thread)."""

    async def body(app: App) -> None:
        done: dict[str, float] = {}

        async def slow() -> None:
            r = await call(app, "POST", CHAT, chat(response_format=schema_format(nested_any_of(8))))
            assert r.status == 400 and "grammar_timeout_s" in r.error()["message"], r.body
            assert r.error()["param"] == "response_format.json_schema.schema"
            done["slow"] = time.monotonic()

        async def plain() -> None:
            await asyncio.sleep(0.05)
            for _ in range(3):
                assert answer((await call(app, "POST", CHAT, chat())).json()) == "bcd"
            done["plain"] = time.monotonic()

        await asyncio.gather(slow(), plain())
        assert done["plain"] < done["slow"]
        r = await call(app, "POST", CHAT, chat(response_format=schema_format(nested_any_of(8))))
        assert r.status == 400  # remembered as refused

    run(make_app("real", grammar_timeout_s=0.3), body)


class FailingCompiler(GrammarCompiler):
    """Every constraint compiles to a matcher that refuses its third token."""

    def compile(self, spec: ConstraintSpec) -> Compiled:
        return Compiled(Failing(3), False, 0.0)  # type: ignore[arg-type]  # a test Constraint


def test_a_matcher_failing_mid_way_is_an_error_never_stop() -> None:
    def build(cfg: EngineConfig) -> tuple[AsyncEngine, ServedModel]:
        grammars = FailingCompiler("{}", 1, (), 1, 5.0)
        engine = Engine(SuccRunner(block_size=cfg.block_size), cfg)
        return AsyncEngine(engine, grammars), byte_model(cfg, engine.max_model_len, model_id="succ")

    async def body(app: App) -> None:
        req = chat(structured_outputs={"regex": "[a-z]*"}, max_tokens=10)
        r = await call(app, "POST", CHAT, req)
        assert r.status == 500 and r.error()["code"] == "structured_output_failed" and "injected" in r.body.decode()
        r = await call(app, "POST", CHAT, {**req, "stream": True})
        events = r.events()
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "structured_output_failed" and "refused token" in err["message"]
        assert all(ch.get("finish_reason") != "stop" for e in events[:-2] for ch in json.loads(e)["choices"])
        deltas = [ch["delta"].get("content") or "" for e in events[:-2] for ch in json.loads(e)["choices"]]
        assert "".join(deltas) == "bc"  # what came before the refusal
        assert app.engine is not None and app.engine.stats().kv_blocks_used == 0
        assert answer((await call(app, "POST", CHAT, chat())).json()) == "bcd"

    config = EngineConfig(model_dir="models/succ", block_size=4)
    run(App(config, build, handle_signals=False, start_health=False), body)


def test_structured_output_metrics() -> None:
    async def body(app: App) -> None:
        req = chat(response_format=schema_format(), max_tokens=200)
        first = await asyncio.gather(*(call(app, "POST", CHAT, req) for _ in range(3)))  # one compile, shared
        assert [r.status for r in first] == [200] * 3
        await call(app, "POST", CHAT, req)
        await call(app, "POST", CHAT, chat(structured_outputs={"regex": "a(b"}))
        assert metric(app, 'tl_structured_output_requests_total{kind="json",outcome="compiled"}') == 1
        assert metric(app, 'tl_structured_output_requests_total{kind="json",outcome="cached"}') == 3
        assert metric(app, 'tl_structured_output_requests_total{kind="regex",outcome="refused"}') == 1
        assert metric(app, "tl_structured_output_compile_seconds_count") == 1

    run(make_app("real"), body)


@pytest.fixture(params=["fake", "real"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]
