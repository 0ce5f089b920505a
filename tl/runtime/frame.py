"""One step as every process of a multi-host job runs it, and how the runner reaches the channel.

Owns: `StepFrame` (the compiled variant, the packed host buffers of tl/runtime/step_io.py, the
penalties' leaves, the token bitmask, whether top-logprobs run) with its byte form, and
`StepPeers`, the protocol of the leader's end of the step channel as the runner calls it. The
channel itself (sockets, liveness, failure) is tl/entry/multihost.py's, which imports the frame
from here; tl/entry/build.py hands its Leader to the runner. Pure host data: numpy, no jax.
Tested by tests/entry/test_multihost.py.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Protocol

import numpy as np

_STEP = struct.Struct("<iiBHHB")  # t_pad, s_pad, top, buffers, penalty leaves, masks (0 or 1)


@dataclass(frozen=True, slots=True)
class StepFrame:
    """Everything a follower needs to run the leader's step: which compiled variant, its packed
    inputs (tl/runtime/step_io.py's `to_host_buffers`), the penalties' leaves (None: the all-zero
    ones), the [R, W] token bitmask (None: every token allowed) and whether top-logprobs run after it."""

    variant: tuple[int, int]
    bufs: tuple[np.ndarray, ...]
    penalties: tuple[np.ndarray, ...] | None
    mask: np.ndarray | None
    top: bool

    def encode(self) -> bytes:
        arrays = [*self.bufs, *(self.penalties or ()), *(() if self.mask is None else (self.mask,))]
        head = _STEP.pack(
            self.variant[0],
            self.variant[1],
            int(self.top),
            len(self.bufs),
            len(self.penalties) if self.penalties is not None else 0xFFFF,
            0 if self.mask is None else 1,
        )
        return head + b"".join(_encode_array(a) for a in arrays)

    @staticmethod
    def decode(data: bytes) -> StepFrame:
        t_pad, s_pad, top, n_bufs, n_pen, n_mask = _STEP.unpack_from(data)
        at = _STEP.size
        arrays = []
        for _ in range(n_bufs + (0 if n_pen == 0xFFFF else n_pen) + n_mask):
            a, at = _decode_array(data, at)
            arrays.append(a)
        bufs = tuple(arrays[:n_bufs])
        pen = None if n_pen == 0xFFFF else tuple(arrays[n_bufs : n_bufs + n_pen])
        mask = arrays[-1] if n_mask else None
        return StepFrame((t_pad, s_pad), bufs, pen, mask, bool(top))


def _encode_array(a: np.ndarray) -> bytes:
    if not a.flags.c_contiguous:
        a = a.copy(order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
    dt = a.dtype.str.encode()
    return struct.pack(f"<B{len(dt)}sB{a.ndim}I", len(dt), dt, a.ndim, *a.shape) + a.tobytes()


def _decode_array(data: bytes, at: int) -> tuple[np.ndarray, int]:
    (n,) = struct.unpack_from("<B", data, at)
    dt, ndim = struct.unpack_from(f"<{n}sB", data, at + 1)
    at += 2 + n
    shape = struct.unpack_from(f"<{ndim}I", data, at)
    at += 4 * ndim
    dtype = np.dtype(dt.decode())
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    a = np.frombuffer(data, dtype, count=size // dtype.itemsize, offset=at).reshape(shape)
    return a, at + size


class StepPeers(Protocol):
    """The leader's end of the multi-host step channel (tl/entry/multihost.py's Leader): each step's
    frame goes to the followers before the leader runs it."""

    def send_step(self, frame: StepFrame) -> None: ...

    def step_ended(self) -> None: ...

    def broken(self, error: BaseException) -> Exception:
        """The exception to raise for a step that raised here (the group has failed by then)."""
        ...

    def stop(self) -> None: ...
