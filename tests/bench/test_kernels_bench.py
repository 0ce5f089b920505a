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
