"""Weights on transparent huge pages: the CPU backend's parameters in one host mapping.

Owns: copying a pytree of host weights into one anonymous mapping, 2 MiB-aligned and advised
MADV_HUGEPAGE, and handing each leaf to JAX without a copy (DLPack: XLA:CPU reads the
mapping itself); and the reason when that cannot run (not Linux, THP "never", no mmap).
The placement (tl/runtime/placement.py) calls it for a single CPU device; nothing else does.

Why: a one-row decode step streams every weight once (538 MB for SmolLM2-135M). XLA's own
buffers sit on 4 KiB pages, so the step walks the page tables every 4 KiB of weights; on 2 MiB
pages it walks them 512x less often. Measured on the 2-core Xeon, one decode stream: in-process,
fresh processes alternated, 40.8 -> 42.7 and 40.5 -> 41.9 tok/s; over HTTP in one `bench http
--compare` run 41.3 -> 43.0 (as much as `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` gains, which
puts the whole heap on huge pages). One-row matmul chains on 4 KiB pages read at 19-26 GB/s,
on huge pages 23-29, where numpy's x.x (numpy advises its large arrays) reads at 30.

Leaves DLPack cannot carry (ml_dtypes' bfloat16: a bfloat16 model) are copied into XLA's
buffers as before. Lifetime: each JAX array holds its DLPack capsule, the capsule the numpy
view, the view the mapping; the mapping is unmapped when the last array goes. Nothing writes
the mapping after the copy.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

HUGE_PAGE = 2 << 20
ALIGN = 64  # every leaf starts on a cache line (XLA:CPU's own alignment)
MADV_HUGEPAGE = 14
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def unavailable_reason() -> str:
    """Empty when weights can go on huge pages here, else why not."""
    if not sys.platform.startswith("linux"):
        return f"transparent huge pages are Linux only (platform {sys.platform})"
    try:
        mode = THP_ENABLED.read_text()
    except OSError:
        return f"cannot read {THP_ENABLED}"
    if "[never]" in mode:
        return f"transparent huge pages are off ({THP_ENABLED}: never)"
    return ""


def place(tree: Any, shardings: Any) -> tuple[Any, int]:
    """Every numpy leaf of `tree` copied into one mapping advised for huge pages, as JAX arrays
    aliasing it with the matching single-device sharding of `shardings` (a tree of the same
    structure; the runner's NamedShardings over a one-device mesh); and the mapping's size in
    bytes. Raises OSError where the mapping or the advice fails."""
    leaves, treedef = jax.tree.flatten(tree)
    targets = treedef.flatten_up_to(shardings)  # type: ignore[attr-defined]  # jaxlib's PyTreeDef stub lacks it
    arrays = [np.ascontiguousarray(x) for x in leaves]
    offsets, size = [], 0
    for a in arrays:
        offsets.append(size)
        if _aliasable(a):
            size += -(-a.nbytes // ALIGN) * ALIGN
    if size == 0:
        raise OSError("no weight is of a dtype DLPack carries (bfloat16 weights take XLA's buffers)")
    total = -(-size // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(region, dtype=np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    arena = raw[start : start + total]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(arena.ctypes.data), ctypes.c_size_t(total), MADV_HUGEPAGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_HUGEPAGE) of {total} bytes failed")
    out = []
    for a, off, sharding in zip(arrays, offsets, targets, strict=True):
        if len(sharding.device_set) != 1:
            raise OSError(f"weights on huge pages take one device, not {len(sharding.device_set)}")
        if not _aliasable(a):
            out.append(jax.device_put(a, sharding))
            continue
        view = arena[off : off + a.nbytes].view(a.dtype).reshape(a.shape)
        view[...] = a
        (device,) = sharding.device_set
        try:
            x = jax.dlpack.from_dlpack(view, device=device, copy=False)
        except ValueError as e:  # copy=False: JAX refuses rather than copies
            raise OSError(f"JAX cannot alias a {a.dtype}{list(a.shape)} weight: {e}") from None
        x = jax.make_array_from_single_device_arrays(a.shape, sharding, [x])  # the sharding, no copy
        if x.unsafe_buffer_pointer() != view.ctypes.data:  # a copy would undo the point; never seen
            raise OSError(f"JAX copied a {a.dtype}{list(a.shape)} weight instead of aliasing the mapping")
        out.append(x)
    return jax.tree.unflatten(treedef, out), total


def _aliasable(a: np.ndarray) -> bool:
    """DLPack carries numpy's own bool, int, uint and float dtypes, not ml_dtypes' bfloat16 (a
    bfloat16 model's weights take XLA's buffers)."""
    return a.size > 0 and a.dtype.kind in "biuf"
