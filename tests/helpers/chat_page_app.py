"""The granian target of tests/serve/test_chat_page.py: serve.app's App over the real
tl.core.engine.Engine and a runner that plays a script, slowly enough to be stopped.

`tests.helpers.chat_page_app:app` (the repository root on PYTHONPATH): every answer is CHAT_PAGE_SCRIPT's bytes (the
byte tokenizer of tests/helpers/fake_engine.py), then the script again from its start, until the
request's max_tokens (no EOS; sampling parameters are ignored), one token a step and
CHAT_PAGE_STEP_DELAY_S per step. So an answer capped at the script's length is the script
exactly, and a long one streams long enough to press Stop. The backend card is a made-up
BackendInfo, so the page has one to show.
"""

from __future__ import annotations

import os
import time

from serve.app import App
from tests.helpers.fake_engine import SuccRunner, byte_grammars, byte_model, byte_tools
from tl.core.async_engine import AsyncEngine
from tl.core.config import EngineConfig
from tl.core.plan import RunnerOutput, SchedulerOutput, SeqResult
from tl.core.stats import BackendInfo
from tl.entry.served import ServedModel

BACKEND = BackendInfo(
    device_kind="test runner",
    kernel_choices=("decode x1: reference (scripted)",),
    reasons=("the scripted runner of tests/helpers/chat_page_app.py: no model",),
)


class ScriptRunner(SuccRunner):
    """A Runner whose next token is script[num_generated % len(script)]."""

    def __init__(self, script: bytes, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]  # SuccRunner's keywords
        self.script = script
        self.backend_info = BACKEND

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        time.sleep(self.step_delay_s)
        results = [
            SeqResult(w.seq_id, (self.script[w.num_generated % len(self.script)],), (0.0,), ())
            for w in plan.work
            if w.sample
        ]
        return RunnerOutput(tuple(results))


def make_engine(cfg: EngineConfig) -> tuple[AsyncEngine, ServedModel]:
    from tl.core.engine import Engine

    runner = ScriptRunner(
        os.environ["CHAT_PAGE_SCRIPT"].encode(),
        block_size=cfg.block_size,
        num_kv_blocks=cfg.num_kv_blocks,
        max_model_len=4096,
        step_delay_s=float(os.environ.get("CHAT_PAGE_STEP_DELAY_S", "0.005")),
    )
    engine = Engine(runner, cfg)
    return AsyncEngine(engine, byte_grammars(cfg)), byte_model(cfg, engine.max_model_len, tools=byte_tools())


app = App(engine_factory=make_engine)
