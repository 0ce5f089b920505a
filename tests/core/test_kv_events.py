"""The prefix cache's events (tl/core/kv_events.py, BlockManager.publish_events): the documented
chain hash against its definition written out byte by byte, a prompt's blocks stored as one chain
from the root, a shared prefix stored once, an eviction removed by the same hash, nothing recorded
unless asked. The hypothesis state machine of test_block_manager.py replays the events against
the index after every operation."""

from __future__ import annotations

import hashlib

import pytest

from tl.core.block_manager import BlockManager
from tl.core.kv_events import BlockRemoved, BlockStored, chain_hash

BS = 4


def documented(parent: int, tokens: list[int]) -> int:
    """The hash as the module's docstring defines it, spelled out."""
    data = bytes([(parent >> (8 * (7 - i))) & 0xFF for i in range(8)])
    for t in tokens:
        data += bytes([t & 0xFF, (t >> 8) & 0xFF, (t >> 16) & 0xFF, (t >> 24) & 0xFF])
    return int(hashlib.sha256(data).hexdigest()[:16], 16)


def test_the_chain_hash_is_the_documented_one() -> None:
    assert chain_hash(None, [1, 2, 3, 4]) == documented(0, [1, 2, 3, 4])
    h = chain_hash(None, [70000, 0, 5, 2**31])
    assert h == documented(0, [70000, 0, 5, 2**31]) and 0 <= h < 2**64
    assert chain_hash(h, [9, 9, 9, 9]) == documented(h, [9, 9, 9, 9])
    assert chain_hash(h, [9, 9, 9, 9]) != chain_hash(None, [9, 9, 9, 9])  # a block's hash names its prefix
    # pinned: the same value in every process and release (a router may keep it across restarts)
    assert chain_hash(None, [1, 2, 3, 4]) == 0x9C3FB1B4D48D2330


def run(bm: BlockManager, seq_id: int, tokens: list[int]) -> None:
    prefix = bm.lookup(tokens)
    assert bm.allocate(seq_id, len(tokens), prefix)
    bm.cache_blocks(seq_id, tokens, len(tokens))


def test_a_prompt_is_one_chain_a_shared_prefix_is_stored_once_an_eviction_removed() -> None:
    bm = BlockManager(5, BS, enable_prefix_cache=True)
    bm.publish_events()
    run(bm, 1, list(range(10)))  # two full blocks, a partial one
    h0 = chain_hash(None, [0, 1, 2, 3])
    h1 = chain_hash(h0, [4, 5, 6, 7])
    assert bm.take_events() == [BlockStored(h0, None, (0, 1, 2, 3)), BlockStored(h1, h0, (4, 5, 6, 7))]
    run(bm, 2, [*range(8), 50, 51, 52, 53, 54])  # shares both blocks, stores its third
    assert bm.take_events() == [BlockStored(chain_hash(h1, [50, 51, 52, 53]), h1, (50, 51, 52, 53))]
    bm.free(1)
    bm.free(2)
    assert bm.take_events() == []  # freed blocks stay cached: nothing removed
    run(bm, 3, list(range(100, 117)))  # 5 blocks: two blank, three evicted (LRU: the tails first)
    removed = [e for e in bm.take_events() if isinstance(e, BlockRemoved)]
    assert {e.block_hash for e in removed} == {h0, h1, chain_hash(h1, [50, 51, 52, 53])}
    bm.check_invariants()


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_nothing_is_recorded_unless_asked(prefix_cache: bool) -> None:
    bm = BlockManager(8, BS, enable_prefix_cache=prefix_cache)
    run(bm, 1, list(range(12)))
    assert bm.events == [] and bm._ext_of == {}
    bm.check_invariants()
