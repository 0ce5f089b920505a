"""The granian target of the server tests: serve.app's App over an engine that needs no JAX.

`tests.helpers.fake_app:app` (the repository root on PYTHONPATH) is the real
tl.core.engine.Engine over the succ runner of tests/helpers/fake_engine.py
(`make_real_async_engine`; FAKE_STEP_DELAY_S and FAKE_MAX_LEN tune it),
handed to the App as its engine factory: the server's engine is an explicit argument, never
an import path from the environment. Used by tests/serve/test_serve_http.py (and `think_app` by
tests/text/test_reasoning.py).
"""

from __future__ import annotations

from serve.app import App
from tests.helpers.fake_engine import make_real_async_engine, make_script_async_engine
from tests.helpers.fake_think import make_think_async_engine

app = App(engine_factory=make_real_async_engine)

script_app = App(engine_factory=make_script_async_engine)
"""`tests.helpers.fake_app:script_app`: every answer is FAKE_SCRIPT (tests/helpers/fake_engine.py ScriptEngine)."""

think_app = App(engine_factory=make_think_async_engine)
"""`tests.helpers.fake_app:think_app`: a scripted reasoning model (tests/helpers/fake_think.py ThinkEngine)."""
