"""The KV-event publisher (tl/runtime/kv_publisher.py) over real ZMQ sockets on loopback: a SUB
socket sees each batch as [topic, sequence, msgpack payload] in vLLM's shape (events as maps
tagged by type, a chain's blocks in one BlockStored), the replay socket resends the kept batches
from a sequence number and ends with -1, and a bad address is an error naming the key."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from tests.helpers.granian_server import free_port
from tl.core.config import EngineConfig
from tl.core.kv_events import BlockRemoved, BlockStored, chain_hash
from tl.runtime.kv_publisher import ZmqPublisher, encode_batch, kv_publisher

H0 = chain_hash(None, [1, 2])
H1 = chain_hash(H0, [3, 4])
H2 = chain_hash(None, [7, 7])


def test_a_batch_is_vllms_shape_with_a_chain_in_one_event() -> None:
    events = [BlockStored(H0, None, (1, 2)), BlockStored(H1, H0, (3, 4)), BlockStored(H2, None, (7, 7))]
    ts, out = msgspec.msgpack.decode(encode_batch(12.5, [*events, BlockRemoved(H0), BlockRemoved(H2)], 2))
    assert ts == 12.5
    stored = {"block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None}
    assert out == [
        {"type": "BlockStored", "block_hashes": [H0, H1], "parent_block_hash": None, "token_ids": [1, 2, 3, 4]}
        | stored,
        {"type": "BlockStored", "block_hashes": [H2], "parent_block_hash": None, "token_ids": [7, 7]} | stored,
        {"type": "BlockRemoved", "block_hashes": [H0, H2], "medium": "GPU"},
    ]


def test_batches_reach_a_subscriber_and_the_replay_socket_resends_them() -> None:
    pub_at, replay_at = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cfg = EngineConfig(kv_events_endpoint=pub_at, kv_events_replay_endpoint=replay_at, kv_events_topic="kv")
    publisher = kv_publisher(cfg, 2)
    assert isinstance(publisher, ZmqPublisher)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub_at)
    try:
        got: list[list[bytes]] = []
        deadline = time.monotonic() + 10
        while not got:  # a PUB socket drops what it sends before the subscription arrives
            publisher.publish([BlockStored(H0, None, (1, 2))])
            if sub.poll(200):
                got.append(sub.recv_multipart())
            assert time.monotonic() < deadline
        publisher.publish([BlockRemoved(H0)])
        assert sub.poll(5000)
        got.append(sub.recv_multipart())
        (topic, seq0, first), (_, seq1, second) = got
        assert topic == b"kv" and int.from_bytes(seq1, "big") == int.from_bytes(seq0, "big") + 1
        assert msgspec.msgpack.decode(first)[1][0]["block_hashes"] == [H0]
        assert msgspec.msgpack.decode(second)[1] == [{"type": "BlockRemoved", "block_hashes": [H0], "medium": "GPU"}]
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay_at)
        dealer.send_multipart([b"", seq0])
        replies = []
        while True:
            assert dealer.poll(5000)
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                break
            replies.append((seq, payload))
        assert replies == [(seq0, first), (seq1, second)]
        dealer.close(0)
    finally:
        sub.close(0)
        ctx.term()
        publisher.close()


def test_an_address_that_cannot_be_bound_names_its_key() -> None:
    with pytest.raises(ValueError, match="kv_events_endpoint = 'tcp://nowhere.invalid:1'"):
        ZmqPublisher("tcp://nowhere.invalid:1", "", "", 16)
    assert kv_publisher(EngineConfig(), 16) is None


def test_the_config_refuses_events_without_a_prefix_cache() -> None:
    with pytest.raises(ValueError, match='kv_events_endpoint needs prefix_cache = "radix"'):
        EngineConfig(kv_events_endpoint="tcp://127.0.0.1:1", prefix_cache="none")
    with pytest.raises(ValueError, match="kv_events_replay_endpoint needs kv_events_endpoint"):
        EngineConfig(kv_events_replay_endpoint="tcp://127.0.0.1:1")
