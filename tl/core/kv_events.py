"""KV-cache events: the prefix cache's blocks as they are indexed and evicted, for the routers that
send a request where its prefix is already cached (vllm-router's kv_aware policy).

Owns the records (BlockStored, BlockRemoved), the KVEventSink protocol the engine hands each
step's events to, and the block hash the events carry: `chain_hash(parent, tokens)`, the first 8
bytes (big-endian, an unsigned 64-bit integer) of SHA-256 over the parent block's hash (8 bytes,
big-endian; ROOT_HASH = 0 for a prompt's first block) followed by the block's token ids (4 bytes
each, little-endian). The same bytes give the same hash in every process and after every restart,
and a block's hash names its whole prefix. The block manager computes it only while a sink
listens (tl/core/block_manager.py); its own index keeps Python's hash of (parent, tokens).
Pure Python; the wire format lives with the publisher (tl/runtime/kv_publisher.py).
Tested by tests/core/test_kv_events.py.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

ROOT_HASH = 0


def chain_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The documented hash of a block of tokens after the block whose hash is parent (None: the
    prompt's first block, hashed after ROOT_HASH)."""
    head = (ROOT_HASH if parent is None else parent).to_bytes(8, "big")
    digest = hashlib.sha256(head + struct.pack(f"<{len(tokens)}I", *tokens)).digest()
    return int.from_bytes(digest[:8], "big")


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A full block's KV computed and indexed for reuse."""

    block_hash: int
    parent_hash: int | None  # None: the prompt's first block
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """An indexed block evicted (its KV overwritten by another sequence's)."""

    block_hash: int


KVEvent = BlockStored | BlockRemoved


class KVEventSink(Protocol):
    """Where the engine sends its prefix cache's events."""

    def publish(self, events: Sequence[KVEvent]) -> None:
        """One step's events, in order, on the engine thread: must not block."""
        ...

    def close(self) -> None:
        """No more events: release sockets and threads."""
        ...
