"""serve.app's App over the fake engines in memory, for the ASGI tests of tests/serve/: make_app
(the FakeEngine or the real Engine over the succ runner, 4-token KV blocks), run (a body against the
served app with a timeout), chat bodies, a stream's content and a metric's value. Must hold no tests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from serve.app import App
from tests.helpers.asgi_client import Reply, served
from tests.helpers.fake_engine import (
    ConcatTemplate,
    FakeEngine,
    FakeRunner,
    SuccRunner,
    byte_grammars,
    byte_model,
    byte_tools,
)
from tl.core.async_engine import AsyncEngine
from tl.core.config import EngineConfig
from tl.core.engine import Engine
from tl.entry.served import ServedModel

CHAT = "/v1/chat/completions"


HAND = {"model": "succ", "messages": [{"role": "user", "content": "a"}], "max_tokens": 3, "temperature": 0}


def factory(
    kind: str, delay: float = 0.0, template: Any = None
) -> Callable[[EngineConfig], tuple[AsyncEngine, ServedModel]]:
    def build(cfg: EngineConfig) -> tuple[AsyncEngine, ServedModel]:
        tmpl = template or ConcatTemplate()
        if kind == "fake":
            engine: Any = FakeEngine(FakeRunner(), cfg, delay)
        else:
            engine = Engine(SuccRunner(block_size=cfg.block_size, num_kv_blocks=256, step_delay_s=delay), cfg)
        return AsyncEngine(engine, byte_grammars(cfg)), byte_model(
            cfg, engine.max_model_len, tmpl, byte_tools(), "succ"
        )

    return build


def make_app(kind: str, delay: float = 0.0, template: object = None, **cfg: Any) -> App:
    config = EngineConfig(model_dir="models/succ", block_size=4, **cfg)
    return App(config, factory(kind, delay, template), handle_signals=False, start_health=False)


def run(app: App, body: Callable[[App], Awaitable[None]], timeout: float = 20.0) -> None:
    async def main() -> None:
        async with served(app):
            await asyncio.wait_for(body(app), timeout)

    asyncio.run(main())


def chat(**kw: Any) -> dict[str, Any]:
    return {**HAND, **kw}


def content(r: Reply) -> str:
    """Concatenated deltas of a chat stream."""
    text = ""
    for e in r.events()[:-1]:
        for ch in json.loads(e)["choices"]:
            text += ch["delta"].get("content") or ""
    return text


def metric(app: App, name: str) -> float:
    for line in app.metrics.render("")[0].decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)
