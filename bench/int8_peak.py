"""The int8 ceiling bench http prints beside the memory and GEMM ones: bench/int8_peak.cc compiled
for this CPU's native build (kernels/cpu_build.py `best`: its -march and ISA flags) and run on
every core, from registers (what the quantized matmuls' integer products could reach at most).

Owns: `measure` (int8 multiply-adds a second and the instruction, or None where no x86 SIMD
build or no compiler: the line then says so) and `describe` (the roofline's words for it).
Tested by tests/bench/test_bench_harness.py.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path


def measure(threads: int = 0, iters: int = 100_000_000) -> tuple[float, str] | None:
    """(multiply-adds a second over `threads` threads, 0: every core; the instruction), or None."""
    from kernels import cpu_build

    try:
        target = cpu_build.best()
        cxx = cpu_build.compiler(target)
    except cpu_build.NativeUnavailable:
        return None
    if target.arch != "x86_64" or target.rank < 1:  # the SSE2 build has no int8 dot worth a ceiling
        return None
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "int8_peak"
        src = Path(__file__).with_name("int8_peak.cc")
        build = [cxx, "-O2", f"-march={target.march}", *target.extra, str(src), "-o", str(exe), "-lpthread"]
        if subprocess.run(build, capture_output=True, check=False).returncode != 0:
            return None
        n = str(threads or os.cpu_count() or 1)
        out = subprocess.run([str(exe), n, str(iters)], capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), " ".join(out[1:-1])


def describe(peak: tuple[float, str] | None, threads: int = 0) -> str:
    if peak is None:
        return "int8 ceiling: not measured (no x86 SIMD build or no compiler)"
    n = threads or os.cpu_count() or 1
    return f"int8 {peak[0] / 1e9:.0f} GMAC/s ({peak[1]} from registers, {n} threads)"
