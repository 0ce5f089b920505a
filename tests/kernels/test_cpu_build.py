"""kernels/cpu_build.py: every target compiles warning-free on any machine, the targets a CPU runs
follow its flags, a failed build is one readable line and is not retried, and a server whose
library cannot be built answers on the reference kernels.

Every target (x86-64, x86-64-v3, x86-64-v4, x86-64-v4-vnni, sapphirerapids, aarch64,
aarch64-dotprod) is compiled with -Wall
-Wextra and no warning here, whatever this CPU (the builds this CPU runs: their library's build
log, read; the others: compiled to objects with -Werror): a branch only one CPU family takes can no longer
break unseen. aarch64 needs Debian's cross compiler (g++-aarch64-linux-gnu; `make test` installs
it where apt-get can). The builds this CPU can run are also linked, loaded and tested, kernel by
kernel, in tests/kernels/test_cpu_native.py.
"""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path

import httpx
import pytest

from kernels import cpu_build
from kernels.cpu_build import NativeUnavailable
from tests.helpers.granian_server import ROOT, free_port, granian_argv, running

ELF_MACHINE = {"x86_64": 62, "aarch64": 183}


@pytest.mark.parametrize("target", cpu_build.TARGETS, ids=[t.name for t in cpu_build.TARGETS])
def test_every_target_compiles_without_warnings(target: cpu_build.Target, tmp_path: Path) -> None:
    try:
        cpu_build.compiler(target)
    except NativeUnavailable as e:
        if target.arch == platform.machine():
            raise
        pytest.skip(f"{e}: apt-get install g++-{target.arch.replace('_', '-')}-linux-gnu (make test does)")
    lib = None if cpu_build.missing(target) else cpu_build.build(target)
    if lib is not None and lib.with_suffix(".log").exists():  # built for tests/kernels/test_cpu_native.py: read its log
        log = lib.with_suffix(".log").read_text()
        assert "warning:" not in log and "error" not in log, log
        commands = [line for line in log.splitlines() if line.startswith("$ ")]
        compiled = sorted(Path(line.split(" -c ", 1)[1].split()[0]).stem for line in commands if " -c " in line)
        assert compiled == sorted(s.stem for s in cpu_build.sources()), log  # a command line a source, none missing
        assert all(
            f"-march={target.march}" in line and "-Wall -Wextra" in line and all(f in line for f in target.extra)
            for line in commands
        )
        objects = [lib]
    else:
        objects = cpu_build.compile_objects(target, tmp_path)  # -Werror: a warning fails
        assert sorted(o.stem for o in objects) == sorted(s.stem for s in cpu_build.sources())
    for obj in objects:
        head = obj.read_bytes()[:20]
        assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == ELF_MACHINE[target.arch]


def test_runnable_targets_follow_the_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    v3 = cpu_build.BY_NAME["x86-64-v3"].needs
    cases = [
        ("x86_64", {"sse2"}, ["x86-64"]),
        ("x86_64", v3 | {"sse2"}, ["x86-64-v3", "x86-64"]),
        ("x86_64", cpu_build.BY_NAME["x86-64-v4"].needs | {"sse2"}, ["x86-64-v4", "x86-64-v3", "x86-64"]),
        (
            "x86_64",
            cpu_build.BY_NAME["x86-64-v4-vnni"].needs | {"sse2"},
            ["x86-64-v4-vnni", "x86-64-v4", "x86-64-v3", "x86-64"],
        ),
        (
            "x86_64",
            cpu_build.BY_NAME["sapphirerapids"].needs | {"sse2"},
            ["sapphirerapids", "x86-64-v4-vnni", "x86-64-v4", "x86-64-v3", "x86-64"],
        ),
        ("aarch64", {"fp", "asimd"}, ["aarch64"]),
        ("aarch64", {"fp", "asimd", "asimddp"}, ["aarch64-dotprod", "aarch64"]),
    ]
    for machine, flags, want in cases:
        monkeypatch.setattr(platform, "machine", lambda m=machine: m)
        monkeypatch.setattr(cpu_build, "cpu_flags", lambda f=flags: frozenset(f))
        assert [t.name for t in cpu_build.runnable()] == want
        assert cpu_build.best().name == want[0]
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: frozenset(v3 - {"fma"}) | {"sse2"})
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert cpu_build.missing(cpu_build.BY_NAME["x86-64-v3"]) == ["fma"]


def test_a_build_this_cpu_cannot_run_is_refused() -> None:
    other = next(t for t in cpu_build.TARGETS if cpu_build.missing(t))
    with pytest.raises(NativeUnavailable, match=f"this CPU cannot run the {other.name} build"):
        cpu_build.build(other)


def _fake_compiler(tmp_path: Path) -> tuple[Path, Path]:
    calls = tmp_path / "calls"
    cxx = tmp_path / "fake-g++"
    cxx.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\n'
        'case "$1" in --version) echo "fake-g++ 1.0"; exit 0;; esac\n'
        'echo "attention.cc:12:3: warning: not this line" >&2\n'
        'echo "attention.cc:40:7: error: the first error" >&2\n'
        'echo "attention.cc:41:1: error: a second one" >&2\nexit 1\n'
    )
    cxx.chmod(0o755)
    return cxx, calls


def test_a_failed_build_is_one_line_and_remembered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cxx, calls = _fake_compiler(tmp_path)
    where = {"cache_dir": str(tmp_path / "cache"), "cxx": str(cxx)}
    monkeypatch.setattr(cpu_build, "_failures", {})
    target = cpu_build.best()
    with pytest.raises(NativeUnavailable) as first:
        cpu_build.build(target, **where)
    msg = str(first.value)
    assert "\n" not in msg and "error: the first error" in msg and "a second one" not in msg
    assert f"native kernels ({target.name}) failed" in msg and f"command: {cxx}" in msg
    log = Path(msg.split("full log: ")[1].rstrip(")"))
    assert "a second one" in log.read_text()  # the whole output is kept there

    def compiles() -> int:
        return sum("--version" not in line for line in calls.read_text().splitlines())

    n = compiles()
    assert n == len(cpu_build.sources())  # one compiler process a source
    for fresh_process in (False, True):
        if fresh_process:  # the failure file beside the cache, not this process's memory
            monkeypatch.setattr(cpu_build, "_failures", {})
        with pytest.raises(NativeUnavailable) as again:
            cpu_build.build(target, **where)
        assert str(again.value) == msg and compiles() == n


def test_no_compiler_is_said_so(tmp_path: Path) -> None:
    target = cpu_build.best()
    with pytest.raises(
        NativeUnavailable, match=f"no C\\+\\+ compiler for {target.name}: '/nonexistent/c\\+\\+' not found"
    ):
        cpu_build.build(target, cache_dir=str(tmp_path), cxx="/nonexistent/c++")


def test_the_compiler_and_the_cache_are_arguments_not_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CXX and TL_NATIVE_CACHE are no longer read: `[engine] native_cxx` / `native_cache_dir`
    come down as arguments (empty: g++ or c++, and ~/.cache/tl/native)."""
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setenv("TL_NATIVE_CACHE", str(tmp_path / "from-env"))
    target = cpu_build.best()
    assert cpu_build.compiler(target, "/bin/false") == "/bin/false"
    assert cpu_build.cache_root() == Path.home() / ".cache" / "tl" / "native"
    assert cpu_build.cache_root(str(tmp_path)) == tmp_path
    if shutil.which("g++") or shutil.which("c++"):
        assert cpu_build.compiler(target) in (shutil.which("g++"), shutil.which("c++"))
        assert cpu_build.library_path(target, cache_dir=str(tmp_path)).parent == tmp_path


def test_a_compiler_that_fails_is_the_fallback_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the start-up log says when the library cannot be built: one line, not a page."""
    from kernels import cpu_native, select

    monkeypatch.setattr(cpu_native, "_libraries", {})  # as in a fresh process
    monkeypatch.setattr(cpu_build, "_failures", {})
    native, why = select.native_library("cpu", "auto", cache_dir=str(tmp_path), cxx="/bin/false")
    assert native is None and "\n" not in why
    assert why.startswith(
        f"building the native kernels ({cpu_build.best().name}) failed: no output (command: /bin/false"
    )
    assert "full log: " in why


def test_server_without_a_compiler_answers_on_the_reference(tmp_path: Path, tiny_dir: Path) -> None:
    """TL_ENGINE__NATIVE_CXX=/bin/false and an empty build cache: the server starts, its backend card says
    reference and XLA, and greedy completions equal an in-process engine's on the reference
    kernels."""
    from tl.core.config import EngineConfig
    from tl.core.request import GenRequest, SamplingParams
    from tl.entry.build import build_engine
    from tl.text.tokenizer import Tokenizer

    port, hport = free_port(), free_port()
    engine_toml = (
        f'model_dir = "{tiny_dir}"\nblock_size = 4\nnum_kv_blocks = 64\nmax_num_seqs = 4\n'
        'max_num_batched_tokens = 32\ntoken_buckets = [8, 32]\nseq_buckets = [1, 4]\ncompile_cache_dir = ""\n'
    )
    cfg = tmp_path / "runtime.toml"
    cfg.write_text(f'[engine]\n{engine_toml}http_listen = "127.0.0.1:{port}"\nhealth_listen = "127.0.0.1:{hport}"\n')
    env = {
        **os.environ,
        "TL_CONFIG": str(cfg),
        "PYTHONPATH": str(ROOT),
        "TL_ENGINE__NATIVE_CXX": "/bin/false",
        "TL_ENGINE__NATIVE_CACHE_DIR": str(tmp_path / "cache"),
    }
    prompts = ["The quick brown fox", "abc"]
    with running(granian_argv(port), env, f"http://127.0.0.1:{hport}/readyz", timeout_s=120) as proc:
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]
        card = model["backend"]
        texts = [
            httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                timeout=60,
                json={"model": model["id"], "prompt": p, "max_tokens": 12, "temperature": 0},
            ).json()["choices"][0]["text"]
            for p in prompts
        ]
    assert proc.stdout is not None
    assert card["attention_kernel"] == "reference" and card["matmul_kernel"] == "xla" and card["native_target"] == ""
    assert card["kernel_choices"] == []
    engine = build_engine(
        EngineConfig(
            model_dir=str(tiny_dir),
            block_size=4,
            num_kv_blocks=64,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            token_buckets=(8, 32),
            seq_buckets=(1, 4),
            compile_cache_dir="",
            attention_kernel="reference",
            matmul_kernel="xla",
        ),
        warmup=False,
    )
    tok = Tokenizer.load(tiny_dir)
    for prompt, text in zip(prompts, texts, strict=True):
        rid = engine.add_request(GenRequest(tuple(tok.encode(prompt)), SamplingParams(temperature=0.0, max_tokens=12)))
        got: list[int] = []
        while engine.has_work():
            got += [o.token_id for o in engine.step() if o.request_id == rid and o.token_id >= 0]
        assert text == tok.decode(got)
