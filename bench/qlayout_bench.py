"""One-row Q4_1 matmuls on the stored GGUF rows against the panel layout (weight_layout "panels"),
kernel against kernel (bench/qlayout.cc says what each measures).

Compiles bench/qlayout.cc (which includes kernels/cpu/quant.h and quant_avx512.h) with the
x86-64-v4-vnni target's flags (kernels/cpu_build.py) and jaxlib's FFI headers, runs it, and prints
its figures with the CPU's name: one matrix resident in L2 on one thread (the kernels' compute, and whether the two
give the same outputs bit for bit), then SmolLM2-135M's 30 layers of one-row matmuls from memory
on one and two threads. Needs a CPU with AVX-512 VNNI and BF16.
Run: `python -m bench qlayout`.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.report import print_table


def run(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench qlayout")
    ap.parse_args(argv)
    from kernels import cpu_build

    target = cpu_build.BY_NAME["x86-64-v4-vnni"]
    if missing := cpu_build.missing(target):
        print(f"this CPU cannot run {target.name} (no {', '.join(missing)})")
        return 2
    here = Path(__file__).resolve().parent
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "qlayout"
        cmd = [cpu_build.compiler(target), *cpu_build._flags(target), str(here / "qlayout.cc")]
        cmd += [str(cpu_build.SOURCE_DIR / "threads.cc"), "-o", str(exe), "-lpthread"]
        # Inlined into main's loops, GCC 12 cannot bound panels_range's output index and says so.
        cmd += ["-Wno-aggressive-loop-optimizations"]
        subprocess.run(cmd, check=True)
        out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    print(f"cpu: {cpu_build.cpu_model()}")
    rows: list[dict[str, object]] = []
    for line in out.splitlines():
        words = line.split()
        if words and words[0] == "case":
            rows.append({"case": words[1], **dict(zip(words[2::2], words[3::2], strict=True))})
    print_table(rows)
    return 0
