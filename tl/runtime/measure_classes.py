"""What start-up times each native kernel at, and the records of what it found.

Owns the classes (`MATMUL_ROWS`), `Verdict` (one class's times) and
`Verdicts` (every class's, and the one choice per kernel they make). A leaf: the execution plan
(tl/runtime/execution.py) reads the records, the measurement (tl/runtime/verdicts.py) fills them.
Tested by tests/runtime/test_verdicts.py.

One choice per kernel, not per step shape: a kernel runs natively at every step shape or at none
(`Verdicts.native`: the geometric mean of its classes' speedups above 1, each class counted
once). The native kernels and XLA's compute a row in different orders (the integer kernels
quantize activations to int8, XLA's dot does not), so a choice by shape made a request's answer
depend on how many rows its step held (issue 48).

Classes (`MATMUL_ROWS`), each timed once; together they decide the matmul: by rows, 1, 4, 16, 64
and the largest token bucket (a native kernel takes any row count: kernels/cpu_native.py runs a
call past its kernel's rows in slices). Each is timed on a chain of the model's own layer
matmuls and its LM head, as a step runs them, over enough layers that the weights stream from
memory as in a real step. The sampler's argmax/logsumexp goes with the matmul's verdict (it is its
own class only in name: measured together, it is a few percent of the LM head's time). Attention
is not measured: on a CPU with the native library it is always the native kernel, the one whose
rows do not depend on their step (kernels/select.py); both matmul forms are batch invariant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MATMUL_ROWS = (1, 4, 16, 64)


@dataclass(frozen=True, slots=True)
class Verdict:
    kernel: str  # "matmul" (layers, LM head and argmax at that row count) or "attention"
    rows: int  # the class: the most rows (tokens, for attention) it covers
    native_ms: float
    xla_ms: float

    @property
    def speedup(self) -> float:
        """XLA's time over the native kernel's (>1: native is faster)."""
        return self.xla_ms / self.native_ms if self.native_ms > 0 else float("inf")

    def line(self) -> str:
        unit = "tokens" if self.kernel == "attention" else "rows"
        times = f"{self.native_ms:.2f} vs {self.xla_ms:.2f} ms"
        return f"{self.kernel} <= {self.rows} {unit}: native {self.speedup:.2f}x XLA ({times})"


@dataclass(frozen=True, slots=True)
class Verdicts:
    """Every class's verdict, and where they came from ("measured in 1.2 s", "cached: PATH")."""

    verdicts: tuple[Verdict, ...] = ()
    source: str = "none"

    def native(self, kernel: str) -> bool:
        """Whether `kernel` runs natively at every step shape: the geometric mean of its classes'
        speedups is above 1 (False with none measured)."""
        classes = self.of(kernel)
        return bool(classes) and math.fsum(math.log(v.speedup) for v in classes) > 0

    def of(self, kernel: str) -> tuple[Verdict, ...]:
        return tuple(sorted((v for v in self.verdicts if v.kernel == kernel), key=lambda v: v.rows))

    def summary(self, kernel: str, native_name: str, other: str) -> str:
        """`native_name` if `kernel` runs natively, else `other`."""
        return native_name if self.native(kernel) else other
