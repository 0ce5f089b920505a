"""tl/runtime/verdicts.py and the per-shape dispatch: each step shape runs the kernel measured faster there.

The lookup by class, the measurement cached beside the library and reused, a runner whose
compiled steps call the native kernels exactly at the shapes its verdicts give them (checked in
each step variant's HLO), forced choices that measure nothing and run native everywhere, and a
real measurement on a tiny model that writes its verdict file.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from test_runner import ENGINE, make_runner

from kernels import paged_attention
from tl.runtime import runner as runner_mod
from tl.runtime import verdicts
from tl.runtime.verdicts import Verdict, Verdicts

V = Verdicts(
    (
        Verdict("matmul", 1, 1.0, 2.0),
        Verdict("matmul", 4, 3.0, 2.0),
        Verdict("matmul", 16, 1.0, 2.0),
        Verdict("matmul", 64, 5.0, 2.0),
        Verdict("attention", 4, 1.0, 3.0),
    ),
    "test",
)


def test_a_count_takes_the_verdict_of_the_smallest_class_at_or_above_it() -> None:
    want = {1: True, 2: False, 4: False, 5: True, 16: True, 17: False, 64: False, 65: False}
    assert {n: V.native("matmul", n) for n in want} == want
    assert V.native("attention", 3) and not V.native("attention", 5)  # past the largest class: XLA
    assert not Verdicts().native("matmul", 1)
    assert V.summary("matmul", "cpu_native", "xla") == "cpu_native+xla"
    assert V.summary("attention", "cpu_native", "reference") == "cpu_native"
    assert V.of("matmul")[0].speedup == 2.0 and "cpu_native (native 2.00x XLA" in V.of("matmul")[0].line()


def _timed(native_s: float, xla_s: float) -> verdicts.Timed:
    return {"native": lambda: time.sleep(native_s), "xla": lambda: time.sleep(xla_s)}


def test_measured_once_then_read_from_the_cache(tmp_path: Path) -> None:
    path = tmp_path / "verdicts-x.json"
    calls: list[tuple[str, int]] = []

    def prepare(kernel: str, rows: int) -> verdicts.Timed:
        calls.append((kernel, rows))
        return _timed(0.001, 0.004) if rows == 1 else _timed(0.004, 0.001)

    classes = [("matmul", 1), ("matmul", 4)]
    first = verdicts.measure(path, {"k": 1}, classes, prepare)
    assert first.native("matmul", 1) and not first.native("matmul", 4) and first.source.startswith("measured in")
    assert sorted(calls) == classes and json.loads(path.read_text())["shapes"] == {"k": 1}
    again = verdicts.measure(path, {"k": 1}, classes, prepare)
    assert again.source == f"cached: {path}" and again.verdicts == first.verdicts and len(calls) == 2
    verdicts.measure(path, {"k": 1}, [*classes, ("attention", 4)], prepare)  # other classes: measured anew
    assert len(calls) == 5
    path.write_text("{not json")
    assert verdicts.measure(path, {"k": 1}, classes, prepare).source.startswith("measured")  # a torn file is ignored


def _hlo(runner: runner_mod.ModelRunner, t: int, s: int) -> str:
    lowered, _ = runner.program.lowered((t, s))
    return str(lowered.as_text())


def _native_calls(runner: runner_mod.ModelRunner, t: int, s: int) -> set[str]:
    assert runner.kernels.native is not None
    hlo = _hlo(runner, t, s)
    return {base for base, name in runner.kernels.native.ffi_names.items() if f"@{name}(" in hlo}


def test_each_step_shape_runs_what_its_verdicts_say(monkeypatch: pytest.MonkeyPatch) -> None:
    crafted = Verdicts(
        (
            Verdict("matmul", 1, 1.0, 2.0),
            Verdict("matmul", 4, 2.0, 1.0),
            Verdict("matmul", 16, 2.0, 1.0),
            Verdict("matmul", 32, 1.0, 2.0),
            Verdict("attention", 4, 1.0, 2.0),
            Verdict("attention", 32, 2.0, 1.0),
        ),
        "crafted",
    )
    monkeypatch.setattr(verdicts, "measure", lambda *a, **k: crafted)
    runner, _ = make_runner(ENGINE.replace(token_buckets=(1, 8, 32), max_num_batched_tokens=32))
    if runner.kernels.native is None:
        pytest.skip("the native library does not build here (tests/test_cpu_build.py says why)")
    assert runner.plan.verdicts is crafted
    one = _native_calls(runner, 1, 1)  # 1 token: matmuls class 1 (native), attention class 4 (native)
    assert {"tl_gemv", "tl_small_attention", "tl_argmax_lse"} <= one
    eight = _native_calls(runner, 8, 4)  # 8 tokens: matmuls class 16 (XLA), attention class 32 (reference)
    assert eight.isdisjoint({"tl_gemv", "tl_small_attention", "tl_paged_attention_cached", "tl_local_attention"})
    assert "tl_argmax_lse" not in eight  # 4 sample rows: class 4, XLA
    big = _native_calls(runner, 32, 4)  # 32 tokens: matmul class 32 native; attention reference
    assert "tl_gemv" in big and "tl_paged_attention_cached" not in big
    info = runner.backend_info
    assert info.attention_kernel == "cpu_native+reference" and info.matmul_kernel == "cpu_native+xla"
    assert len(info.kernel_choices) == 6


def test_forced_native_kernels_measure_nothing_and_run_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verdicts, "measure", lambda *a, **k: pytest.fail("a forced choice measured"))
    runner, _ = make_runner(ENGINE.replace(attention_kernel="cpu_native", matmul_kernel="cpu_native"))
    if runner.kernels.native is None:
        pytest.skip("the native library does not build here (tests/test_cpu_build.py says why)")
    assert runner.plan.verdicts.verdicts == () and runner.backend_info.kernel_choices == ()
    for t, s in ((8, 4), (32, 4)):
        assert {"tl_gemv", "tl_paged_attention_cached"} & _native_calls(runner, t, s)
    xla, _ = make_runner(ENGINE.replace(attention_kernel="reference", matmul_kernel="xla"))
    assert xla.backend_info.attention_kernel == "reference" and xla.backend_info.matmul_kernel == "xla"
    assert "tl_" not in _hlo(xla, 8, 4)


def test_a_real_measurement_covers_every_class_and_is_saved() -> None:
    runner, _ = make_runner(ENGINE.replace(token_buckets=(1, 8, 32), max_num_batched_tokens=32))
    if runner.kernels.native is None:
        pytest.skip("the native library does not build here (tests/test_cpu_build.py says why)")
    got = {(v.kernel, v.rows) for v in runner.plan.verdicts.verdicts}
    assert got == {("matmul", 1), ("matmul", 4), ("matmul", 16), ("matmul", 32), ("attention", 4), ("attention", 32)}
    assert all(v.native_ms > 0 and v.xla_ms > 0 for v in runner.plan.verdicts.verdicts)
    path = (
        Path(runner.plan.verdicts.source.split()[-1])
        if "saved to" in runner.plan.verdicts.source
        else Path(runner.plan.verdicts.source.removeprefix("cached: "))
    )
    saved = json.loads(path.read_text())
    assert len(saved["verdicts"]) == 6 and saved["shapes"]["classes"] == sorted([list(c) for c in got])


def test_block_weights_make_the_largest_token_bucket_a_class_of_its_own() -> None:
    """Where the integer kernel takes any row count of q8_0 weights (the AVX-512 VNNI builds'
    panel kernel), a prompt chunk of 128 tokens is measured (and run) as its own class; where it
    takes 64 (the other builds), and for a float32 model (the float32 few-row kernel takes at
    most 64 rows), no class past 64 is measured."""
    engine = ENGINE.replace(token_buckets=(1, 8, 128), max_num_batched_tokens=128, seq_buckets=(1, 4))
    runner, _ = make_runner(engine.replace(weight_dtype="q8_0"))
    native = runner.kernels.native
    if native is None:
        pytest.skip("the native library does not build here (tests/test_cpu_build.py says why)")
    any_rows = native.qgemm_max_rows("q8_0") >= 128
    layer = runner.params.layers[0]
    mm = runner.kernels.matmul.fn
    assert mm is not None and verdicts.takes_rows(mm, layer, 128) == any_rows
    matmuls = {v.rows for v in runner.plan.verdicts.verdicts if v.kernel == "matmul"}
    assert matmuls == ({1, 4, 16, 64, 128} if any_rows else {1, 4, 16, 64})
    dense, _ = make_runner(engine)
    assert not verdicts.takes_rows(mm, dense.params.layers[0], 128)
    assert verdicts.takes_rows(mm, dense.params.layers[0], 64)
    assert {v.rows for v in dense.plan.verdicts.verdicts if v.kernel == "matmul"} == {1, 4, 16, 64}


def test_the_start_up_compiles_run_on_daemon_threads_in_order() -> None:
    """measure()'s prepares: results in order, every item run, the first item's error raised, and
    on daemon threads (an executor's would be joined at the exit, holding a stop)."""
    import threading

    from tl.runtime.verdicts import _map_on_daemon_threads

    seen: list[tuple[int, bool]] = []

    def square(x: int) -> int:
        seen.append((x, threading.current_thread().daemon))
        return x * x

    assert _map_on_daemon_threads(square, [3, 1, 2], 2) == [9, 1, 4]
    assert sorted(seen) == [(1, True), (2, True), (3, True)]

    def fails(x: int) -> int:
        seen.append((x, True))
        if x in (2, 4):
            raise ValueError(f"item {x}")
        return x

    seen.clear()
    with pytest.raises(ValueError, match="item 2"):
        _map_on_daemon_threads(fails, [1, 2, 3, 4], 2)
    assert len(seen) == 4


def test_the_largest_attention_class_is_a_prompt_chunk_after_decodes() -> None:
    """The case timed for the largest token bucket is a busy server's large step: 15 decodes at
    DECODE_CONTEXT (or what a block table holds) packed first (head_rows), then one fresh prompt
    chunk filling the bucket; both kernels compute the same attention on it."""
    runner, _ = make_runner(ENGINE.replace(token_buckets=(1, 8, 32), max_num_batched_tokens=32))
    if runner.kernels.native is None:
        pytest.skip("the native library does not build here (tests/test_cpu_build.py says why)")
    plan, cfg = runner.plan, runner.model_config
    k, v = runner.kv_cache
    case = verdicts.attention_case(
        32, False, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, k,
        plan.chunk_blocks, plan.max_blocks, plan.compute_dtype, decodes=verdicts.PROMPT_CLASS_DECODES,
    )  # fmt: skip
    q, kv, meta = case
    d = verdicts.PROMPT_CLASS_DECODES
    ctx = min(verdicts.DECODE_CONTEXT, runner.block_size * (plan.max_blocks - 1))  # as long as a table holds
    assert meta.head_rows == d and q.shape[0] == 32
    assert list(np.asarray(meta.seq_idx)) == list(range(d)) + [d] * (32 - d)
    assert list(np.asarray(meta.positions)) == [ctx] * d + list(range(32 - d))
    assert list(np.asarray(meta.start_pos)) == [ctx] * d + [0]
    timed = verdicts.attention_timed(runner.kernels.attention.fn, paged_attention.paged_attention, case, k, v, 2)
    np.testing.assert_allclose(np.asarray(timed["native"]()), np.asarray(timed["xla"]()), rtol=1e-4, atol=1e-4)
