"""Building the native CPU kernels (kernels/cpu/*.cc) into one shared library per target.

Owns: the targets the library is built for (TARGETS: each an -march with any further ISA flags,
the architecture it runs on and the CPU flags it needs), which of them this CPU runs (`runnable`, `best`), building
a target's library on first use into the build cache, compiling any target to objects only
(`compile_objects`, what the tests do for targets this machine cannot run), and a failed
build's report: one readable line (the first compiler error, the command, where the full log
is), remembered beside the cache so that the library is not rebuilt on every call.
Must not: load the library or know its kernels (kernels/cpu_native.py does), or read the
environment (the cache and the compiler are arguments, from `[engine] native_cache_dir` and
`native_cxx`). Tested by tests/kernels/test_cpu_build.py.

The cache (`[engine] native_cache_dir`, passed down as `cache_dir`; empty: ~/.cache/tl/native)
holds `<target>-<key>.so`, the key a hash of every source and header, the flags, jaxlib's
version and the compiler's own version line, so a changed source, jaxlib or compiler builds
afresh; a build is written to a temporary name and renamed into place when complete (concurrent
builders are harmless). A build leaves `<target>-<key>.log` (the compilers' whole output), a
failed one also `<target>-<key>.failed` (the one-line report).

Why named targets, not -march=native: every target is then one binary the tests can build and
run on any machine that runs it (an AMX Xeon runs the AVX2 and AVX-512 builds too, so AVX2
code is tested there), and the build that serves is one the tests ran.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE_DIR = Path(__file__).parent / "cpu"
FLAGS = ("-O3", "-ffast-math", "-std=c++17", "-fPIC", "-Wall", "-Wextra", "-Wno-psabi")
"""-Wno-psabi: GCC notes that a 64-byte vector argument's ABI differs without AVX-512; every such
function is internal to the library. The jaxlib FFI headers come in with -isystem: their own
warnings (-Wsign-compare, -Wreturn-type after exhaustive switches) are jaxlib's, not ours."""

_V3 = frozenset({"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm", "xsave"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_VNNI = ("-mavx512vnni", "-mavx512bf16")
_SPR = _V4 | {
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "avx512vbmi",
    "avx512_vbmi2",
    "avx512_bitalg",
    "avx512_vpopcntdq",
    "avx512ifma",
    "avx_vnni",
    "gfni",
    "vaes",
    "vpclmulqdq",
    "movdiri",
    "movdir64b",
    "serialize",
}


class NativeUnavailable(RuntimeError):
    """The native library cannot be built or run here (no compiler, a failed build, a target this
    CPU cannot run, an unsupported dtype or shape); the message says which, in one line."""


@dataclass(frozen=True, slots=True)
class Target:
    name: str  # the [engine] native_target value and the library's file name prefix
    arch: str  # platform.machine() of the CPUs that run it
    march: str  # the compiler's -march
    needs: frozenset[str]  # CPU flags (/proc/cpuinfo) the code may use
    rank: int  # higher is preferred among the targets a CPU runs
    extra: tuple[str, ...] = ()  # ISA flags beyond -march (e.g. -mavx512vnni), part of the build key


TARGETS: tuple[Target, ...] = (
    Target("x86-64", "x86_64", "x86-64", frozenset({"sse2"}), 0),  # SSE2: every x86-64 CPU
    Target("x86-64-v3", "x86_64", "x86-64-v3", _V3, 1),  # AVX2 + FMA (Haswell, Zen)
    Target("x86-64-v4", "x86_64", "x86-64-v4", _V4, 2),  # AVX-512 (Skylake-SP)
    # + VNNI (int8 dot products: the quantized matmuls) and BF16 (Cascade Lake, Ice Lake, Zen 4-5)
    Target("x86-64-v4-vnni", "x86_64", "x86-64-v4", _V4 | {"avx512_vnni", "avx512_bf16"}, 3, _VNNI),
    Target("sapphirerapids", "x86_64", "sapphirerapids", _SPR, 4),  # + AMX-BF16 (matmul_precision "high")
    Target("aarch64", "aarch64", "armv8-a", frozenset({"asimd"}), 0),  # NEON: every ARMv8 CPU
    Target("aarch64-dotprod", "aarch64", "armv8.2-a+dotprod", frozenset({"asimd", "asimddp"}), 1),  # + SDOT
)
BY_NAME = {t.name: t for t in TARGETS}


def cache_root(cache_dir: str = "") -> Path:
    """The build cache: `cache_dir`, or ~/.cache/tl/native where it is empty."""
    return Path(cache_dir) if cache_dir else Path.home() / ".cache" / "tl" / "native"


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (x86 "flags", ARM "Features" of /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_model() -> str:
    """The CPU's model name (lscpu's "Model name"), for the verdict cache and benchmark reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "CPU part"):
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def missing(target: Target) -> list[str]:
    """What this machine lacks to run `target` (empty: it runs it)."""
    if platform.machine() != target.arch:
        return [f"a {target.arch} CPU (this is {platform.machine()})"]
    return sorted(target.needs - cpu_flags())


def runnable() -> list[Target]:
    """The targets this CPU runs, most capable first."""
    return sorted((t for t in TARGETS if not missing(t)), key=lambda t: -t.rank)


def best() -> Target:
    """The most capable target this CPU runs. Raises NativeUnavailable on other architectures."""
    targets = runnable()
    if not targets:
        raise NativeUnavailable(f"no native kernel build for a {platform.machine()} CPU")
    return targets[0]


def compiler(target: Target, cxx: str = "") -> str:
    """The C++ compiler for `target`: `cxx` (empty: g++, else c++) for this machine's architecture,
    Debian's cross compiler (e.g. aarch64-linux-gnu-g++) for another. Raises NativeUnavailable."""
    if target.arch == platform.machine():
        want = cxx or "g++"
        found = shutil.which(want) or (None if cxx else shutil.which("c++"))
    else:
        want = f"{target.arch}-linux-gnu-g++"
        found = shutil.which(want)
    if not found:
        raise NativeUnavailable(f"no C++ compiler for {target.name}: {want!r} not found")
    return found


def sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.cc"))


def _include_dir() -> str:
    import jax

    return str(jax.ffi.include_dir())


_version_lines: dict[str, str] = {}


def _compiler_version(cxx: str) -> str:
    if cxx not in _version_lines:
        try:
            out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
        except OSError as e:
            raise NativeUnavailable(f"the C++ compiler {cxx!r} does not run: {e}") from e
        _version_lines[cxx] = (out.splitlines() or ["?"])[0]
    return _version_lines[cxx]


def _flags(target: Target, extra: tuple[str, ...] = ()) -> list[str]:
    return [*FLAGS, f"-march={target.march}", *target.extra, *extra, "-isystem", _include_dir()]


def _key(target: Target, cxx: str, extra: tuple[str, ...]) -> str:
    import jaxlib

    h = hashlib.sha256()
    for path in [*sources(), *sorted(SOURCE_DIR.glob("*.h"))]:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    for part in (" ".join(_flags(target, extra)), jaxlib.__version__, _compiler_version(cxx)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def _first_error(log: str) -> str:
    for line in log.splitlines():
        if "error" in line:
            return line.strip()
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    return lines[0] if lines else "no output"


def _compile(cxx: str, target: Target, extra: tuple[str, ...], outdir: Path) -> tuple[list[Path], str]:
    """Every source to an object in outdir, in parallel (one compiler process a source), and the
    compilers' output. Raises _BuildFailed with the first error and the whole output."""
    flags = _flags(target, extra)
    jobs = []
    for src in sources():
        obj = outdir / (src.stem + ".o")
        cmd = [cxx, *flags, "-c", str(src), "-o", str(obj)]
        jobs.append((cmd, obj, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    failed, logs = [], []
    for cmd, _, proc in jobs:
        out, _ = proc.communicate(timeout=600)
        logs.append(f"$ {' '.join(cmd)}\n{out}")
        if proc.returncode != 0:
            failed.append((cmd, out))
    if failed:
        raise _BuildFailed(" ".join(failed[0][0]), _first_error(failed[0][1]), "\n".join(logs))
    return [obj for _, obj, _ in jobs], "\n".join(logs)


class _BuildFailed(Exception):
    def __init__(self, cmd: str, first: str, log: str) -> None:
        super().__init__(first)
        self.cmd, self.first, self.log = cmd, first, log


_failures: dict[str, str] = {}  # library path -> its one-line report (this process)


def library_path(target: Target, *, cache_dir: str = "", cxx: str = "") -> Path:
    """Where `target`'s library for these sources, flags, jaxlib and compiler lives (built or not)
    in the cache `cache_dir` (empty: the default), built by `cxx` (empty: the default compiler)."""
    found = compiler(target, cxx)
    return cache_root(cache_dir) / f"{target.name}-{_key(target, found, ())}.so"


def build(target: Target, *, cache_dir: str = "", cxx: str = "") -> Path:
    """`target`'s library, compiled now by `cxx` into the cache `cache_dir` if it has none (empty:
    the defaults, see `compiler` and `cache_root`). Raises NativeUnavailable: no compiler, a build
    that failed (now or before: remembered in `<name>.failed`), or a target this CPU cannot run."""
    if lacks := missing(target):
        raise NativeUnavailable(f"this CPU cannot run the {target.name} build (lacks {', '.join(lacks)})")
    out = library_path(target, cache_dir=cache_dir, cxx=cxx)
    failed = out.with_suffix(".failed")
    if str(out) in _failures:
        raise NativeUnavailable(_failures[str(out)])
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    found = compiler(target, cxx)
    # One compile of a library at a time on this machine: another process building it (a second
    # server, a test worker) is waited for, and its library taken, not compiled again beside it.
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            return out
        if failed.exists():
            _failures[str(out)] = failed.read_text().strip()
            raise NativeUnavailable(_failures[str(out)])
        _compile_library(found, target, out)
    return out


def _compile_library(found: str, target: Target, out: Path) -> None:
    """`target`'s library compiled by `found` into a temporary directory beside `out`, then moved
    there (its compile log beside it); a failure is remembered in `<name>.failed`."""
    failed = out.with_suffix(".failed")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        try:
            objects, compile_log = _compile(found, target, (), Path(tmp))
            lib = Path(tmp) / "lib.so"
            cmd = [found, "-shared", "-o", str(lib), *map(str, objects)]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
            if res.returncode != 0:
                raise _BuildFailed(" ".join(cmd), _first_error(res.stderr), res.stderr)
        except _BuildFailed as e:
            log = out.with_suffix(".log")
            log.write_text(e.log)
            msg = (
                f"building the native kernels ({target.name}) failed: {e.first}"
                f" (command: {e.cmd[:300]}; full log: {log})"
            )
            failed.write_text(msg + "\n")
            _failures[str(out)] = msg
            raise NativeUnavailable(msg) from None
        out.with_suffix(".log").write_text(compile_log)  # what tests/kernels/test_cpu_build.py reads for warnings
        os.replace(lib, out)


def compile_objects(target: Target, outdir: Path, werror: bool = True, *, cxx: str = "") -> list[Path]:
    """Every source compiled for `target` by `cxx` (see `compiler`) into objects in outdir (no link,
    no cache), warnings as errors by default: how the tests check a target this machine cannot
    run. Raises NativeUnavailable with the first error."""
    try:
        return _compile(compiler(target, cxx), target, ("-Werror",) if werror else (), outdir)[0]
    except _BuildFailed as e:
        raise NativeUnavailable(f"compiling for {target.name} failed: {e.first}\n{e.log}") from None
