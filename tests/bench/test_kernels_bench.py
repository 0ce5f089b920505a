"""bench/kernels_bench.py end to end at tiny sizes: every test row printed with a positive speed-up."""

from __future__ import annotations

import re

import pytest

from bench import kernels_bench
from kernels import cpu_native


def test_kernels_bench_prints_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        kernels_bench.run(["--batch", "2", "--context", "32", "--rows", "1,2", "--repeat", "1", "--layers", "2"]) == 0
    )
    out = capsys.readouterr().out
    tests = re.findall(
        r"^\| (attention|layer matmuls)[^|]*\| (reference|xla) \| [\d.]+ \| [\d.]+ \| ([\d.]+) \|$", out, re.MULTILINE
    )
    # attention, float32 x 2 row counts, int8, and where AMX is, matmul_precision high at 512 rows
    assert len(tests) == 4 + cpu_native.amx_available(), out
    assert all(float(speedup) > 0 for *_, speedup in tests)


def test_qgemm_bench_prints_a_row_for_each_row_count(capsys: pytest.CaptureFixture[str]) -> None:
    """bench/qgemm_bench.py at the smallest real shape, one copy: each row count's line, one row's at 1.00x."""
    from bench import qgemm_bench

    args = ["--shape", "qwen3-0.6b", "--format", "q4_0", "--copies", "1", "--repeat", "1", "--rows", "1,9"]
    assert qgemm_bench.run(args) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (\d+) \| [\d.]+ \| [\d.]+ \| \d+ \| ([\d.]+)x \|$", out, re.MULTILINE)
    assert [r for r, _ in rows] == ["1", "9"], out
    assert rows[0][1] == "1.00" and float(rows[1][1]) > 0
