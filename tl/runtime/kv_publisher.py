"""The prefix cache's events on ZMQ in vLLM's format, so that vllm-router's kv_aware policy reads
tl's cache as it reads vLLM's.

Owns a PUB socket bound at [engine] kv_events_endpoint and, when kv_events_replay_endpoint is
set, a ROUTER socket there, both on one daemon thread that takes each step's events off a queue
(the engine thread never waits on a socket). Each step's events go out as three frames: the
topic, the batch's sequence number (8 bytes, big-endian, from 0), and the msgpack batch
[timestamp, [event, ...]] where each event is a map tagged by "type": BlockStored (block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, lora_name; consecutive blocks of one
chain in one event) or BlockRemoved (block_hashes, medium). The hashes are
tl/core/kv_events.py's documented chain hash. medium is "GPU": vLLM's name for the engine's own
KV cache, which a router credits in full, whatever the device. The replay socket answers
[b"", start] with each kept batch from sequence start on as [b"", seq, payload], then
[b"", -1, b""]; the last REPLAY_KEEP batches are kept. pyzmq is imported only here.
Tested by tests/runtime/test_kv_publisher.py and, behind the real router, tests/serve/test_routers.py.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec

from tl.core.config import EngineConfig
from tl.core.kv_events import BlockRemoved, BlockStored, KVEvent

log = logging.getLogger(__name__)
REPLAY_KEEP = 1000
MEDIUM = "GPU"
_POLL_S = 0.05
_IDLE: tuple[float, list[KVEvent]] = (0.0, [])


def encode_batch(ts: float, events: Sequence[KVEvent], block_size: int) -> bytes:
    """One step's events as vLLM's msgpack batch."""
    out: list[dict[str, Any]] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, BlockStored):
            if last is not None and last["type"] == "BlockStored" and last["block_hashes"][-1] == e.parent_hash:
                last["block_hashes"].append(e.block_hash)
                last["token_ids"].extend(e.token_ids)
                continue
            out.append(
                {
                    "type": "BlockStored",
                    "block_hashes": [e.block_hash],
                    "parent_block_hash": e.parent_hash,
                    "token_ids": list(e.token_ids),
                    "block_size": block_size,
                    "lora_id": None,
                    "medium": MEDIUM,
                    "lora_name": None,
                }
            )
        elif isinstance(e, BlockRemoved):
            if last is not None and last["type"] == "BlockRemoved":
                last["block_hashes"].append(e.block_hash)
                continue
            out.append({"type": "BlockRemoved", "block_hashes": [e.block_hash], "medium": MEDIUM})
    return msgspec.msgpack.encode([ts, out])


class ZmqPublisher:
    """tl.core.kv_events.KVEventSink over ZMQ (see the module's docstring)."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str, block_size: int) -> None:
        try:
            import zmq
        except ImportError as e:
            raise ValueError("kv_events_endpoint needs the pyzmq package (pip install pyzmq)") from e
        self._zmq = zmq
        self._block_size = block_size
        self._topic = topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = self._ctx.socket(zmq.ROUTER) if replay_endpoint else None
        for key, sock, addr in (
            ("kv_events_endpoint", self._pub, endpoint),
            ("kv_events_replay_endpoint", self._replay, replay_endpoint),
        ):
            if sock is None:
                continue
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.bind(addr)
            except zmq.ZMQError as e:
                self._ctx.destroy(0)
                raise ValueError(f"{key} = {addr!r}: {e}") from e
        self._queue: queue.SimpleQueue[tuple[float, list[KVEvent]] | None] = queue.SimpleQueue()
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_KEEP)
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="tl-kv-events", daemon=True)
        self._thread.start()
        log.info("publishing KV-cache events on %s%s", endpoint, f" (replay on {replay_endpoint})" * bool(self._replay))

    def publish(self, events: Sequence[KVEvent]) -> None:
        self._queue.put((time.time(), list(events)))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5.0)

    def _run(self) -> None:
        try:
            while True:
                try:
                    item = self._queue.get(timeout=_POLL_S if self._replay is not None else None)
                except queue.Empty:
                    item = _IDLE  # nothing this poll: the replay socket is served all the same
                if self._replay is not None:
                    self._serve_replay()
                if item is None:
                    return
                ts, events = item
                if events:
                    payload = encode_batch(ts, events, self._block_size)
                    seq = self._seq.to_bytes(8, "big")
                    self._pub.send_multipart((self._topic, seq, payload))
                    self._kept.append((self._seq, payload))
                    self._seq += 1
        except Exception:
            log.exception("KV-cache event publisher stopped")
        finally:
            self._ctx.destroy(0)

    def _serve_replay(self) -> None:
        zmq, sock = self._zmq, self._replay
        assert sock is not None
        while sock.poll(0, zmq.POLLIN):
            frames = sock.recv_multipart()
            if len(frames) < 3:
                continue
            ident, start = frames[0], int.from_bytes(frames[-1], "big")
            for seq, payload in list(self._kept):
                if seq >= start:
                    sock.send_multipart((ident, b"", seq.to_bytes(8, "big"), payload))
            sock.send_multipart((ident, b"", (-1).to_bytes(8, "big", signed=True), b""))


def kv_publisher(cfg: EngineConfig, block_size: int) -> ZmqPublisher | None:
    """The publisher cfg asks for, or None."""
    if not cfg.kv_events_endpoint:
        return None
    return ZmqPublisher(cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint, cfg.kv_events_topic, block_size)
