"""The import-direction rules of docs/DESIGN.md and ../shared/STYLE.md, checked on the source
(a forbidden-import hook).

- tl/ is layered (LAYERS: core, model, runtime, text, entry; tl/__init__.py): a subpackage imports
  only the layers it may; kernels/ imports nothing from tl; no module of tl/ imports serve or
  bench; nothing in tl/, kernels/ or serve/ imports bench.
- The core (and the model's config) never imports jax or numpy.
- Only the device runtime and the model's jax side import jax (JAX_LAYERS less NO_JAX),
  besides kernels/ and bench/.
- Only the runner and the placement of weights and KV cache create device arrays (device_put,
  DLPack, arrays from device buffers): DEVICE_PLACERS.
- serve/ uses only the engine's public API: of tl, the modules in SERVE_API and no private
  (underscored) name; never the scheduler, block manager, runner, kernels or jax.
- No environment variables read deep in the library: tl/ and kernels/ read none, but for the
  assembly (tl/entry/build.py hands the environment to jax.distributed's set-up), and no module of
  tl/ or serve/ imports a module by a name it computes (importlib, __import__).
- Only tl/text/grammar.py imports llguidance (GRAMMAR_OWNERS): the scheduler and runner see a
  constraint through tl.core.request's Guide protocol.
- Every file a module's docstring names (its tests, its neighbours) exists.

Each rule is `violations(rel, source)`, tried on the tree and on snippets that break it.
"""

from __future__ import annotations

import ast
import importlib
import re
import typing
from pathlib import Path

import pytest

from tl.model import encodings, weights
from tl.model.encodings import Encoding

ROOT = Path(__file__).resolve().parents[1]

LAYERS = {
    "core": {"core"},
    "model": {"core", "model"},
    "runtime": {"core", "model", "runtime"},
    "text": {"core", "model", "text"},
    "entry": {"core", "model", "runtime", "text", "entry"},
}
"""Each subpackage of tl/ and the layers it may import (tl/__init__.py says what each owns)."""
PURE_LAYERS = ("core",)
PURE = ["tl/model/config.py"]
"""Modules outside the pure layers that import no jax or numpy either."""
JAX_LAYERS = ("runtime", "model")
NO_JAX = {"tl/model/config.py", "tl/model/files.py", "tl/model/gguf_model.py", "tl/model/convert_gguf.py"}
"""Only the device runtime and the model's jax side import jax; these model modules do not."""
DEVICE_PLACERS = {"tl/runtime/runner.py", "tl/runtime/placement.py", "tl/runtime/weight_pages.py"}
"""The modules that put host data on devices (device_put, DLPack, arrays made from device
buffers): the runner (each step's inputs) and the placement of weights and the KV cache."""
PLACING_CALLS = ("device_put", "from_dlpack", "make_array_from_single_device_arrays", "make_array_from_callback")
SERVE_FORBIDDEN = (
    "tl.core.scheduler",
    "tl.core.block_manager",
    "tl.runtime.runner",
    "tl.core.sequence",
    "tl.runtime.sampler",
    "tl.model.llama",
    "jax",
)


GRAMMAR_OWNERS = {"tl/text/grammar.py"}
"""The one module that talks to llguidance (compiling constraints, the per-sequence matcher)."""
SERVE_API = (
    "tl.core.config",
    "tl.core.request",
    "tl.core.async_engine",
    "tl.core.stats",
    "tl.entry.build",
    "tl.entry.served",
    "tl.text.tools",
    "tl.text.reasoning",
)
"""What serve/ may import of tl: configuration, the request records and their errors, the
AsyncEngine, the stats records, the one function that builds the engine, the record of the
served model it builds beside it (tl.entry.served: tokenizer and template behind protocols), and
the tool-call formats with their parser, and the reasoning markers with theirs."""
ENV_READERS = {"tl/entry/build.py"}
PACKAGES = ("tl", "serve", "kernels")


def imported(source: str) -> set[str]:
    """Every absolute module name `source` imports, at any depth (TYPE_CHECKING blocks too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if node.module == "tl":  # `from tl import core`: the layer is the name imported
                names.update(f"tl.{a.name}" for a in node.names)
    return names


def imports(path: Path) -> set[str]:
    return imported(path.read_text())


def _private_names(source: str, prefix: str) -> list[str]:
    """`module.name` for each underscored name imported from a module under `prefix`."""
    return [
        f"{node.module}.{a.name}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.module and top(node.module) == prefix
        for a in node.names
        if a.name.startswith("_")
    ]


def _reads_environment(source: str) -> bool:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "environb", "getenv"):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            if any(a.name in ("environ", "environb", "getenv") for a in node.names):
                return True
    return False


def _computes_imports(source: str) -> bool:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in ("import_module", "__import__"):
                return True
    return "importlib" in {top(n) for n in imported(source)}


def _places_on_device(source: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in PLACING_CALLS:
                out.append(name)
    return out


def violations(rel: str, source: str) -> list[str]:
    """The rules above that module `rel` (a path from the repository root) breaks."""
    pkg, names, out = rel.split("/")[0], imported(source), []
    if pkg in PACKAGES and any(top(n) == "bench" for n in names):
        out.append(f"{rel} imports bench")
    if pkg == "tl" and any(top(n) == "serve" for n in names):
        out.append(f"{rel} imports serve")
    if pkg == "kernels" and (bad := sorted(n for n in names if top(n) == "tl")):
        out.append(f"{rel} imports {bad}: kernels/ is a leaf")
    layer = rel.split("/")[1] if pkg == "tl" and rel.count("/") >= 2 else None
    if layer in LAYERS:
        crossing = sorted(
            n
            for n in names
            if top(n) == "tl" and n != "tl" and n.split(".")[1] in LAYERS and n.split(".")[1] not in LAYERS[layer]
        )
        if crossing:
            out.append(f"{rel} imports {crossing}: tl/{layer} may import only {sorted(LAYERS[layer])}")
    pure = layer in PURE_LAYERS or rel in PURE
    if pure and (bad := sorted(n for n in names if top(n) in ("jax", "jaxlib", "numpy", "flax"))):
        out.append(f"{rel} imports {bad}")
    if pkg == "serve":
        reach = sorted(n for n in names if top(n) == "tl" and not n.startswith(SERVE_API))
        reach += sorted(n for n in names if n.startswith(SERVE_FORBIDDEN) or top(n) == "kernels")
        if reach:
            out.append(f"{rel} reaches past the public engine API ({', '.join(SERVE_API)}): {reach}")
        if private := _private_names(source, "tl"):
            out.append(f"{rel} imports private names {private}")
    if pkg in PACKAGES and rel not in GRAMMAR_OWNERS and any(top(n) == "llguidance" for n in names):
        out.append(f"{rel} imports llguidance; only {sorted(GRAMMAR_OWNERS)} may")
    if pkg in ("tl", "kernels") and rel not in ENV_READERS and _reads_environment(source):
        out.append(f"{rel} reads the environment (make it an [engine] key or an argument)")
    if pkg in ("tl", "serve") and _computes_imports(source):
        out.append(f"{rel} imports a module by a computed name")
    if pkg in ("tl", "serve") and rel not in DEVICE_PLACERS and (calls := _places_on_device(source)):
        out.append(f"{rel} creates device arrays ({', '.join(sorted(set(calls)))}); only {sorted(DEVICE_PLACERS)} may")
    return out


def modules() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


def test_every_module_keeps_the_rules() -> None:
    broken = [v for p in modules() for v in violations(p.relative_to(ROOT).as_posix(), p.read_text())]
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize(
    "rel,source,rule",
    [
        ("tl/runtime/runner.py", "from bench import soak\n", "imports bench"),
        ("kernels/select.py", "import bench.report\n", "imports bench"),
        ("serve/app.py", "from bench.load import x\n", "imports bench"),
        ("tl/core/engine.py", "from serve.errors import ApiError\n", "imports serve"),
        ("tl/entry/cli.py", "def f():\n    import serve.launch\n", "imports serve"),
        ("tl/core/scheduler.py", "import numpy as np\n", "imports ['numpy']"),
        ("tl/core/sequence.py", "import jax.numpy as jnp\n", "imports ['jax.numpy']"),
        (
            "tl/core/engine.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import jax\n",
            "imports ['jax']",
        ),
        ("tl/core/block_manager.py", "from jax import lax\n", "imports ['jax']"),
        ("tl/core/request.py", "import numpy\n", "imports ['numpy']"),
        ("tl/core/plan.py", "import jax\n", "imports ['jax']"),
        ("serve/routes.py", "from tl.core.engine import Engine\n", "public engine API"),
        ("serve/routes.py", "from tl.core.scheduler import Scheduler\n", "public engine API"),
        ("serve/app.py", "import tl.runtime.runner\n", "public engine API"),
        ("serve/app.py", "from tl.text.tokenizer import Tokenizer\n", "public engine API"),
        ("serve/app.py", "from kernels.cpu_build import cpu_model\n", "public engine API"),
        ("serve/app.py", "import jax\n", "public engine API"),
        ("serve/generate.py", "from tl.core.async_engine import _dispatch\n", "private names"),
        ("kernels/cpu_build.py", "import os\nCXX = os.environ.get('CXX')\n", "reads the environment"),
        ("tl/runtime/runner.py", "from os import getenv\n", "reads the environment"),
        ("tl/core/engine.py", "import os\nx = os.getenv('X')\n", "reads the environment"),
        ("serve/app.py", "import importlib\nf = importlib.import_module(name)\n", "computed name"),
        ("tl/entry/build.py", "m = __import__(spec)\n", "computed name"),
        ("tl/runtime/execution.py", "import jax\nx = jax.device_put(y)\n", "creates device arrays"),
        ("tl/model/embedding.py", "from jax import device_put\nx = device_put(y, d)\n", "creates device arrays"),
        ("serve/app.py", "x = jax.dlpack.from_dlpack(v)\n", "creates device arrays"),
        ("tl/core/scheduler.py", "import llguidance\n", "imports llguidance"),
        ("kernels/cpu_native.py", "from tl.model.files import read_config\n", "kernels/ is a leaf"),
        ("tl/core/engine.py", "from tl.runtime.runner import ModelRunner\n", "may import only ['core']"),
        ("tl/runtime/runner.py", "from tl.text.tokenizer import Tokenizer\n", "may import only"),
        ("tl/runtime/compiler.py", "from tl.entry.multihost import StepFrame\n", "may import only"),
        ("tl/model/llama.py", "from tl.runtime.sampler import sample\n", "may import only"),
        ("tl/text/tokenizer.py", "import tl.runtime.backend\n", "may import only"),
        ("tl/model/llama.py", "from tl import runtime\n", "may import only"),
        ("tl/core/scheduler.py", "from tl.text.grammar import too_slow\n", "may import only"),
        ("tl/runtime/runner.py", "from llguidance.numpy import fill_next_token_bitmask\n", "imports llguidance"),
    ],
)
def test_each_rule_catches_what_breaks_it(rel: str, source: str, rule: str) -> None:
    assert any(rule in v for v in violations(rel, source)), violations(rel, source)


def test_what_keeps_the_rules_passes() -> None:
    ok = {
        "tl/core/engine.py": "from tl.core.scheduler import Scheduler\nfrom tl.core.request import GenRequest\n",
        "serve/app.py": "import os\nfrom tl.core.async_engine import AsyncEngine\n"
        "from tl.entry.build import build_async_engine\n"
        "path = os.environ.get('TL_CONFIG')\n",
        "serve/routes.py": "from tl.core.request import EmbedRequest, RequestError\nfrom serve import errors\n",
        "tl/entry/build.py": "import os\ninit(os.environ)\n",
        "tl/runtime/runner.py": "import jax\nimport numpy as np\n",
        "bench/soak.py": "import os\nfrom serve.app import App\nimport importlib\n",
    }
    for rel, source in ok.items():
        assert violations(rel, source) == [], (rel, violations(rel, source))


_DOC_PATH = re.compile(r"(?<![\w.])(?:[\w-]+/)*[\w-]+\.(?:py|md|cc|h|toml)\b")


def stale_paths(rel: str, doc: str) -> list[str]:
    """Files `doc` names that do not exist: a path is read from the repository root (or beside
    the module, or under docs/ and kernels/cpu/), a bare name may live anywhere in the tree."""
    here = (ROOT / rel).parent
    out = []
    for name in _DOC_PATH.findall(doc):
        if "/" in name:
            found = any((base / name).exists() for base in (ROOT, here, ROOT / "docs", ROOT / "kernels" / "cpu"))
        else:
            found = any(".venv" not in p.parts and "artifacts" not in p.parts for p in ROOT.rglob(name) if p.is_file())
        if not found:
            out.append(name)
    return out


def test_module_docstrings_name_files_that_exist() -> None:
    stale = []
    for path in modules():
        rel = path.relative_to(ROOT).as_posix()
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        stale += [f"{rel} names {name}" for name in stale_paths(rel, doc)]
    assert not stale, "\n".join(stale)


def test_a_stale_docstring_path_is_caught() -> None:
    assert stale_paths("tl/core/engine.py", "Tested by tests/core/test_engine.py and tests/test_gone.py.") == [
        "tests/test_gone.py"
    ]
    assert stale_paths("serve/app.py", "the drain of server-stack.md; see README.md") == ["server-stack.md"]
    assert stale_paths("kernels/cpu_native.py", "kernels/cpu_build.py builds it; simd.h") == []


def test_the_encodings_registry_lists_every_encoding_module() -> None:
    """tl/model/weights.py ENCODING_TYPES (and its `Linear` union) names exactly the encodings
    defined under tl/model/encodings/, one module each (a module there that defines none, such
    as ggml_formats.py, holds no class with an encoding's hooks), and the package's docstring
    names every module there."""
    registered = weights.ENCODING_TYPES
    assert set(typing.get_args(weights.Linear)) == set(registered)
    hooks = [n for n in vars(Encoding) if not n.startswith("_")]
    defined: dict[str, list[type]] = {}
    for path in sorted((ROOT / "tl/model/encodings").glob("*.py")):
        if path.name == "__init__.py":
            continue
        module = importlib.import_module(f"tl.model.encodings.{path.stem}")
        defined[path.stem] = [
            c
            for c in vars(module).values()
            if isinstance(c, type) and c.__module__ == module.__name__ and all(hasattr(c, h) for h in hooks)
        ]
        assert f"tl/model/encodings/{path.name}" in (encodings.__doc__ or ""), path.name
    unregistered = [c.__qualname__ for cs in defined.values() for c in cs if not issubclass(c, registered)]
    assert not unregistered, f"encodings missing from ENCODING_TYPES: {unregistered}"
    homes = [c.__module__.rpartition(".")[2] for c in registered]
    assert sorted(homes) == sorted(stem for stem, cs in defined.items() if cs), homes


def top(name: str) -> str:
    return name.split(".")[0]


def test_only_device_modules_import_jax() -> None:
    for path in sorted((ROOT / "tl").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        parts = rel.split("/")
        if len(parts) < 3 or parts[1] not in JAX_LAYERS or rel in NO_JAX:
            bad = {n for n in imports(path) if top(n) in ("jax", "jaxlib", "flax")}
            assert not bad, (
                f"{rel} imports {sorted(bad)}; only tl/{{{','.join(JAX_LAYERS)}}} may (less {sorted(NO_JAX)})"
            )


def test_a_launcher_or_a_follower_imports_no_route() -> None:
    """serve/launch.py (granian's parent) and serve/follower.py (a multi-host follower) take what
    every serving process shares from serve/process.py, never the app with its routes."""
    for rel in ("serve/launch.py", "serve/follower.py"):
        assert not {"serve.app", "serve.routes"} & imports(ROOT / rel), rel


def runtime_imports(source: str) -> set[str]:
    """The absolute module names `source` imports when it runs, at any depth (function-level
    imports too), but not those only the type checker reads (`if TYPE_CHECKING:` blocks)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)  # a submodule imported by name
    return names


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of `graph` (module -> modules it imports): each strongly connected component
    of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_tl() -> None:
    """No two modules of tl/ import each other at run time, directly or round a longer circle
    (a shared record goes to a leaf module instead); type-only imports aside."""
    names = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for p in ROOT.glob("tl/**/*.py")
    }
    graph = {m: {d for d in runtime_imports(p.read_text()) if d in names and d != m} for m, p in names.items()}
    assert import_circles(graph) == []
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
