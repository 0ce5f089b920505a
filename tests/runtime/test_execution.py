"""tl/runtime/execution.py: the execution plan decides every backend choice, once, with its reason, and
is what the runner, the start-up log and the backend card read."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers.models import tiny_cfg
from tests.helpers.runner import ENGINE, make_runner
from tl.core.config import EngineConfig
from tl.runtime import backend
from tl.runtime.execution import Decision, ExecutionPlan, plan_execution

ROOT = Path(__file__).resolve().parents[2]
BACKEND_KEYS = (
    "attention_kernel",
    "matmul_kernel",
    "matmul_precision",
    "weight_pages",
    "weight_layout",
    "kv_cache_dtype",
    "native_target",
)


def _plan(ec: EngineConfig) -> ExecutionPlan:
    cfg = tiny_cfg()
    mesh = backend.make_mesh("cpu", 1)
    return plan_execution(ec, cfg, "cpu", mesh, backend.tp_layout(cfg, 1))


def test_forced_choices_are_configured_and_say_so() -> None:
    plan = _plan(
        ENGINE.replace(
            attention_kernel="reference",
            matmul_kernel="xla",
            matmul_precision="highest",
            weight_pages="default",
            weight_layout="stored",
            kv_cache_dtype="bfloat16",
        )
    )
    assert plan.attention == Decision("reference", "configured")
    assert plan.matmul == Decision("xla", "configured")
    assert plan.precision == Decision("highest", "configured")
    assert plan.weight_pages == Decision("default", "configured")
    assert plan.weight_layout == Decision("stored", "configured")
    assert plan.kv_storage == Decision("bfloat16", "kv_cache_dtype bfloat16") and plan.kv_dtype.name == "uint16"
    assert plan.native_target == "" and plan.measure_classes() == []  # nothing native: nothing to measure
    assert not plan.matmul_measured


def test_high_precision_without_a_native_matmul_runs_highest_and_says_why() -> None:
    plan = _plan(ENGINE.replace(matmul_kernel="xla", matmul_precision="high"))
    assert plan.precision.value == "highest"
    assert plan.precision.reason == "high configured; runs highest: the matmul is xla (configured)"


def test_auto_plan_lists_what_it_measures() -> None:
    plan = _plan(ENGINE)
    if not plan.matmul_measured:
        pytest.skip(f"the native library does not build here: {plan.matmul.reason}")
    assert plan.attention.value == "cpu_native" and plan.native_target
    kinds = {k for k, _ in plan.measure_classes()}
    assert kinds == {"matmul"}  # attention is native without measurement: batch invariant
    assert plan.variants == ((8, 1), (8, 4), (32, 1), (32, 4)) and plan.startup_variants == ((8, 1), (32, 4))


def test_runner_reads_the_measured_plan_and_the_card_shows_it() -> None:
    runner, _ = make_runner(ENGINE.replace(weight_pages="default", matmul_precision="highest"))
    plan = runner.plan
    info = runner.backend_info
    assert (info.platform, info.dtype, info.weight_pages) == ("cpu", "float32", "default")
    assert info.attention_kernel == plan.summary("attention") and info.matmul_kernel == plan.summary("matmul")
    assert info.reasons == tuple(plan.decision_lines()) == tuple(plan.lines()[: len(info.reasons)])
    assert any(line.startswith("weight pages: default (configured)") for line in info.reasons)
    assert any("2 compiled before ready" in line for line in info.reasons)
    assert info.kernel_choices == tuple(v.line() for v in plan.verdicts.verdicts)


def _config_reads(source: str) -> list[tuple[int, str]]:
    """(line, key) of each `<config>.<backend key>` read, the config being any name or attribute
    the tree calls an EngineConfig by (ec, cfg, config, engine_cfg, engine_config)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in BACKEND_KEYS:
            base = node.value
            name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
            if name in ("ec", "cfg", "config", "engine_cfg", "engine_config"):
                out.append((node.lineno, node.attr))
    return out


def test_only_the_plan_reads_the_backend_keys() -> None:
    """One place decides: no module but tl/runtime/execution.py (and the config that defines and checks
    them) reads the backend choices of an EngineConfig."""
    readers = []
    for path in sorted([*ROOT.glob("tl/**/*.py"), *ROOT.glob("serve/*.py"), *ROOT.glob("kernels/*.py")]):
        rel = str(path.relative_to(ROOT))
        if rel not in ("tl/core/config.py", "tl/runtime/execution.py"):
            readers += [f"{rel}:{line}: {key}" for line, key in _config_reads(path.read_text())]
    assert readers == []
    assert _config_reads("def f(ec):\n    return ec.attention_kernel\n") == [(2, "attention_kernel")]
    assert _config_reads("x = self.engine_config.weight_pages\n") == [(1, "weight_pages")]
    assert _config_reads("x = plan.weight_pages.value\n") == []
