"""Opt-in memory diagnostics for soaks: TL_MEMWATCH_S=<seconds> logs, every that many seconds,
the process's RSS beside glibc's heap (in use, free, mmapped) and Python's allocated blocks,
and which object types the collector tracks grew most since the report before. Optional:
- TL_MEMWATCH_HOLDERS=Job,EmbedHandle: per named type, how many are alive and one chain of
  objects holding the oldest (what keeps a finished request alive);
- TL_TRACEMALLOC=<frames>: tracemalloc starts at the first report (after start-up and the
  background compilation, so only what serving allocates is traced and snapshots stay cheap);
  each later report adds the sites holding the most live memory allocated since, and the sites
  that grew most since the report before.

Owns one daemon thread and nothing else; off (no thread, no tracing) unless TL_MEMWATCH_S is
set, so serving pays nothing. It tells Python objects piling up (the types and sites say
which) from native growth (RSS up, Python blocks flat) and from fragmentation (glibc's free
bytes up, in use flat). Object walks run in `quiet` windows (see there). Started by
serve/app.py at start-up. Tested by tests/serve/test_memory.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import sys
import threading
import time
import tracemalloc
import types
from collections import Counter
from collections.abc import Iterator, Mapping

log = logging.getLogger("serve.memwatch")
TOP_SITES = 10
MIB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def glibc_heap() -> tuple[int, int, int] | None:
    """(in use, free, mmapped) bytes of glibc's malloc over all arenas; None off glibc."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    m = fn()
    return int(m.uordblks), int(m.fordblks), int(m.hblkhd)


def line() -> str:
    """RSS, glibc's heap, the collector's object count and what tracemalloc traces."""
    heap = glibc_heap()
    glibc = f", glibc in use {heap[0] / MIB:.1f} MiB free {heap[1] / MIB:.1f} mmap {heap[2] / MIB:.1f}" if heap else ""
    traced = f", traced {tracemalloc.get_traced_memory()[0] / MIB:.2f} MiB" if tracemalloc.is_tracing() else ""
    return f"RSS {rss_bytes() / MIB:.1f} MiB{glibc}, {sys.getallocatedblocks()} Python blocks{traced}"


def sites(snap: tracemalloc.Snapshot, last: tracemalloc.Snapshot | None) -> list[str]:
    """The top live sites of snap, then (with last) the top growth since last."""
    out = []
    for label, stats in (
        ("live", snap.statistics("traceback")),
        ("grew", snap.compare_to(last, "traceback") if last is not None else []),
    ):
        for st in stats[:TOP_SITES]:
            diff = getattr(st, "size_diff", st.size)
            if diff <= 0:
                break
            where = " -> ".join(f"{f.filename.rpartition('/')[2]}:{f.lineno}" for f in st.traceback)
            out.append(f"{label} {diff / 1024:+.1f} KiB ({st.count} blocks, {st.size / 1024:.1f} KiB): {where}")
    return out


def type_counts() -> Counter[str]:
    """Objects the collector tracks, by type name (str, bytes, int and float are not tracked)."""
    return Counter(type(o).__qualname__ for o in gc.get_objects())


def grown_types(now: Counter[str], before: Counter[str]) -> str:
    grown = sorted(((n - before[k], k) for k, n in now.items() if n > before[k]), reverse=True)[:TOP_SITES]
    return ", ".join(f"{k} +{d} ({now[k]})" for d, k in grown)


def _rank(ref: object) -> int:
    """Which referrer to follow: a frame or module ends the chain, code objects say little."""
    if isinstance(ref, types.FrameType | types.ModuleType):
        return 0
    return 2 if isinstance(ref, types.FunctionType | types.CellType | type) else 1


def holders(type_name: str, depth: int = 10) -> str:
    """One chain of objects holding the oldest tracked instance of type_name, nearest first
    (type names, a dict's key, a frame's function), up to depth links; "" if none is alive."""
    found = [o for o in gc.get_objects() if type(o).__qualname__ == type_name]
    if not found:
        return ""
    obj, mine = found[-1], {id(found)}
    del found
    out = []
    for _ in range(depth):
        mine.add(id(sys._getframe()))
        refs = [r for r in gc.get_referrers(obj) if id(r) not in mine]
        if not refs:
            break
        ref = min(refs, key=_rank)
        if isinstance(ref, types.FrameType):
            out.append(f"frame {ref.f_code.co_name} ({ref.f_code.co_filename.rpartition('/')[2]}:{ref.f_lineno})")
            break
        key = next((k for k, v in ref.items() if v is obj), None) if isinstance(ref, dict) else None
        out.append(type(ref).__qualname__ + (f"[{key!r}]" if key is not None else ""))
        if isinstance(ref, types.ModuleType):
            break
        mine.add(id(refs))
        del refs
        obj = ref
    return " <- ".join(out)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """No other thread runs Python code and no collection runs inside: walking every object
    (gc.get_objects) holds a reference to whatever another thread is building, and CPython
    raises SystemError in a thread that resizes a tuple it thinks only it can see (tuple() of a
    generator). Whatever the walk held must be dropped before this exits; make no I/O inside."""
    interval, enabled = sys.getswitchinterval(), gc.isenabled()
    sys.setswitchinterval(3600.0)
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        sys.setswitchinterval(interval)


def _objects(counts: Counter[str], watched: list[str]) -> tuple[Counter[str], list[str]]:
    """(type counts now, a report line per watched type), walked in one quiet window."""
    with quiet():
        now = type_counts()
        lines = [f"types grew: {grown_types(now, counts)}"]
        lines += [f"{name}: {now[name]} alive, the oldest held by: {holders(name)}" for name in watched]
    return now, lines


def _watch(interval_s: float, frames: int, watched: list[str]) -> None:
    last: tracemalloc.Snapshot | None = None
    with quiet():
        counts = type_counts()
    ignore = (tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__))
    while True:
        time.sleep(interval_s)
        try:
            log.info("memwatch: %s", line())
            counts, lines = _objects(counts, watched)
            for text in lines:
                log.info("memwatch %s", text)
            if frames and not tracemalloc.is_tracing():
                tracemalloc.start(frames)
                continue
            if frames:
                snap = tracemalloc.take_snapshot().filter_traces(ignore)
                for s in sites(snap, last):
                    log.info("memwatch %s", s)
                last = snap
        except Exception:
            log.exception("memwatch report failed")


def start(env: Mapping[str, str]) -> bool:
    """Start the watcher if TL_MEMWATCH_S is set (tracing too with TL_TRACEMALLOC); True if started."""
    interval = env.get("TL_MEMWATCH_S", "")
    if not interval:
        return False
    frames = int(env.get("TL_TRACEMALLOC", "0") or 0)
    watched = [n for n in env.get("TL_MEMWATCH_HOLDERS", "").split(",") if n]
    threading.Thread(target=_watch, args=(float(interval), frames, watched), name="tl-memwatch", daemon=True).start()
    log.info("memwatch: a report every %s s, tracemalloc %s", interval, f"{frames} frames" if frames else "off")
    return True
