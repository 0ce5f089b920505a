"""Memory: a finished request leaves nothing for the cyclic collector, and serve/memwatch.py.

A request's objects (its Job, choices, every TokenOut, an embeddings request's vectors) must be
freed by reference counting the moment it ends. Held in a reference cycle they wait for a full
collection instead, and those are rare in a server whose start-up left hundreds of thousands of
long-lived objects: a 30-minute mixed soak grew ~4 MiB a minute that way. Here the collector
is off while requests of every kind run, then nothing of theirs may be left.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from typing import Any

import pytest

from serve import memwatch
from serve.app import App
from serve.asgi import DisconnectWatcher
from serve.generate import Choice, Job
from tests.helpers.asgi_client import call
from tests.helpers.serve_app import CHAT, chat, make_app, run
from tl.core.async_engine import EmbedHandle, RequestHandle
from tl.core.engine import Engine

REQUEST_TYPES = (Job, Choice, RequestHandle, EmbedHandle, DisconnectWatcher)


def _instances() -> list[object]:
    """Every live object of exactly the request types (by type, not name: kernels have a
    Choice too), whoever made it: earlier tests may leave some (pytest keeps what it captured)."""
    with memwatch.quiet():  # the engine thread may be building tuples: see memwatch.quiet
        return [o for o in gc.get_objects() if type(o) in REQUEST_TYPES]


def _new_alive(before: list[object]) -> dict[str, int]:
    """The request-type objects alive now that were not in `before` (held, so no id is reused)."""
    old = {id(o) for o in before}
    new = [type(o).__qualname__ for o in _instances() if id(o) not in old]
    return {name: new.count(name) for name in sorted(set(new))}


def _holders() -> str:
    with memwatch.quiet():
        return "; ".join(f"{t.__qualname__} <- {memwatch.holders(t.__qualname__, 14)}" for t in REQUEST_TYPES)


async def _every_kind(app: App) -> None:
    """One finished request of each kind the soak sends, and the ways they end."""
    await call(app, "POST", CHAT, chat(max_tokens=4))
    await call(app, "POST", CHAT, chat(max_tokens=4, stream=True))
    await call(app, "POST", CHAT, chat(max_tokens=4, stream=True, logprobs=True, top_logprobs=2))
    await call(app, "POST", "/v1/completions", {"model": "succ", "prompt": "ab", "max_tokens": 3, "n": 3})
    await call(app, "POST", CHAT, chat(max_tokens=50, stop=["d"]))  # a stop string aborts the engine request
    await call(app, "POST", "/v1/embeddings", {"model": "succ", "input": ["hello", "a", "xyz"]})
    await call(app, "POST", CHAT, chat(max_tokens=200, stream=True), disconnect_after=0.05)  # the client leaves
    await call(app, "POST", CHAT, chat(max_tokens=200), disconnect_after=0.05)
    await call(app, "POST", "/v1/embeddings", {"model": "succ", "input": ["x" * 200] * 8}, disconnect_after=0.01)
    await call(app, "POST", CHAT, chat(temperature=9))  # a bad request
    await call(app, "POST", CHAT, body=b"{not json")
    for req in (chat(max_tokens=300, stream=True), chat(max_tokens=300)):  # the engine fails mid-request
        task = asyncio.create_task(call(app, "POST", CHAT, req))
        await asyncio.sleep(0.05)
        _fail_next_step(app)
        await task
    embed = asyncio.create_task(call(app, "POST", "/v1/embeddings", {"model": "succ", "input": ["y" * 300] * 8}))
    await asyncio.sleep(0.005)
    _fail_next_step(app)
    await embed
    await asyncio.sleep(0.1)  # cancelled tasks run to their end


def _fail_next_step(app: App) -> None:
    assert app.engine is not None
    eng: Any = app.engine.engine
    if not isinstance(eng, Engine):
        eng.fail_next_step = True
        return
    original = eng.runner.execute

    def boom(plan: object) -> object:
        eng.runner.execute = original
        raise RuntimeError("boom")

    eng.runner.execute = boom


@pytest.mark.parametrize("kind", ["fake", "real"])
def test_a_finished_request_leaves_no_reference_cycle(kind: str) -> None:
    async def body(app: App) -> None:
        logging.disable(logging.ERROR)  # pytest keeps the records it captures, and their tracebacks' frames
        try:
            await _every_kind(app)  # first uses build what is cached for good (the metrics' label sets)
            gc.collect()
            gc.disable()
            before = _instances()
            await _every_kind(app)
            assert _new_alive(before) == {}, _holders()
        finally:
            gc.enable()
            logging.disable(logging.NOTSET)

    run(make_app(kind, 0.002), body)


def test_memwatch_reports_growth_and_holders(caplog: pytest.LogCaptureFixture) -> None:
    class Kept:
        pass

    kept: dict[str, Any] = {"here": [Kept()]}
    with memwatch.quiet():
        before = memwatch.type_counts()
        kept["more"] = [Kept() for _ in range(3)]
        counts, lines = memwatch._objects(before, ["test_memwatch_reports_growth_and_holders.<locals>.Kept"])
    assert counts["test_memwatch_reports_growth_and_holders.<locals>.Kept"] == 4
    assert "Kept +3 (4)" in lines[0]
    assert "held by: list <- dict['" in lines[1]
    assert "RSS" in memwatch.line() and memwatch.rss_bytes() > 0


def test_memwatch_is_off_unless_asked(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "serve.memwatch"):
        assert memwatch.start({}) is False
    assert caplog.records == []
