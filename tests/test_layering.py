"""The import-direction rules of docs/DESIGN.md, checked on the source (a forbidden-import hook).

- The scheduler, block manager, request/plan records and the engine core never import jax
  or numpy.
- Only the runner (and its weight placement and kernel verdicts), the model, the sampler, kernels/
  and bench/ import jax.
- serve/ uses only the engine's public API, never the scheduler, block manager or runner.
- Nothing imports bench.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PURE = [
    "tl/config.py",
    "tl/request.py",
    "tl/plan.py",
    "tl/stats.py",
    "tl/block_manager.py",
    "tl/scheduler.py",
    "tl/sequence.py",
    "tl/spec_decode.py",
    "tl/engine.py",
    "tl/model/config.py",
]
JAX_ALLOWED = {
    "tl/runner.py",
    "tl/verdicts.py",
    "tl/weight_pages.py",
    "tl/sampler.py",
    "tl/model/llama.py",
    "tl/mesh.py",
    "tl/backend.py",
    "tl/async_engine.py",
}
SERVE_FORBIDDEN = (
    "tl.scheduler",
    "tl.block_manager",
    "tl.runner",
    "tl.sequence",
    "tl.sampler",
    "tl.model.llama",
    "jax",
)


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def top(name: str) -> str:
    return name.split(".")[0]


def test_pure_modules_import_no_jax_or_numpy() -> None:
    for rel in PURE:
        path = ROOT / rel
        if path.exists():
            bad = {n for n in imports(path) if top(n) in ("jax", "jaxlib", "numpy", "flax")}
            assert not bad, f"{rel} imports {sorted(bad)}"


def test_only_device_modules_import_jax() -> None:
    for path in sorted((ROOT / "tl").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel not in JAX_ALLOWED:
            bad = {n for n in imports(path) if top(n) in ("jax", "jaxlib", "flax")}
            assert not bad, f"{rel} imports {sorted(bad)}; only {sorted(JAX_ALLOWED)} may"


def test_serve_uses_only_the_public_engine_api() -> None:
    for path in sorted((ROOT / "serve").rglob("*.py")):
        for name in imports(path):
            assert not name.startswith(SERVE_FORBIDDEN), f"{path.relative_to(ROOT)} imports {name}"


def test_nothing_imports_bench() -> None:
    for pkg in ("tl", "serve", "kernels"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            assert not any(top(n) == "bench" for n in imports(path)), f"{path.relative_to(ROOT)} imports bench"
