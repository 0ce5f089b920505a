"""BlockManager: exact ids, refcounts and eviction order with 4-token blocks, then a
hypothesis state machine that checks the books after every operation, and that the prefix
cache's events, replayed, name exactly the blocks indexed (each by its documented chain hash)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tl.core.block_manager import BlockManager
from tl.core.kv_events import BlockStored, chain_hash

BS = 4


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def computed(bm: BlockManager, seq_id: int, tokens: list[int]) -> None:
    """Allocate for all tokens, then mark them computed (as update() does after a step)."""
    assert bm.allocate(seq_id, len(tokens))
    bm.cache_blocks(seq_id, tokens, len(tokens))


def test_allocation_is_fifo_and_free_returns_tail_first() -> None:
    bm = BlockManager(8, BS, enable_prefix_cache=False)
    assert bm.allocate(1, 10)
    assert bm.block_table(1) == (0, 1, 2)
    assert bm.allocate(2, 4)
    assert bm.block_table(2) == (3,)
    assert bm.allocate(1, 13)  # grows by one block
    assert bm.block_table(1) == (0, 1, 2, 4)
    assert bm.allocate(1, 16)  # still fits in 4 blocks
    assert bm.block_table(1) == (0, 1, 2, 4)
    assert bm.ref_counts == [1, 1, 1, 1, 1, 0, 0, 0]
    bm.free(1)
    assert list(bm._free) == [5, 6, 7, 4, 2, 1, 0]
    assert (bm.num_free, bm.num_used, bm.num_cached) == (7, 1, 0)
    bm.check_invariants()


def test_allocate_is_all_or_nothing() -> None:
    bm = BlockManager(4, BS, enable_prefix_cache=False)
    assert bm.allocate(1, 8)
    assert not bm.allocate(2, 12)
    assert not bm.holds(2) and bm.num_free == 2
    assert not bm.allocate(1, 20)
    assert bm.block_table(1) == (0, 1)
    bm.check_invariants()


def test_prefix_hit_shares_full_blocks_but_never_the_last_token() -> None:
    bm = BlockManager(8, BS, enable_prefix_cache=True)
    prompt = toks(10)
    computed(bm, 1, prompt)  # blocks 0, 1 full and indexed; block 2 half full
    assert bm.lookup(prompt) == [0, 1]
    assert bm.lookup(toks(8)) == [0]  # a full hit keeps its last block to compute
    assert bm.lookup(toks(9)) == [0, 1]
    assert bm.lookup(toks(8, start=1)) == []
    assert bm.lookup([0, 1, 2, 3, 9, 9, 9, 9, 9]) == [0]
    assert bm.allocate(2, 12, prefix_blocks=[0, 1])
    assert bm.block_table(2) == (0, 1, 3)
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    bm.check_invariants()


def test_freed_blocks_stay_cached_and_are_revived() -> None:
    bm = BlockManager(8, BS, enable_prefix_cache=True)
    computed(bm, 1, toks(10))
    bm.free(1)
    assert (bm.num_free, bm.num_used, bm.num_cached) == (6, 0, 2)
    assert list(bm._evictable) == [1, 0]  # tail freed first: older, evicted first
    prefix = bm.lookup(toks(12))
    assert prefix == [0, 1]
    assert bm.allocate(2, 12, prefix)
    assert bm.block_table(2) == (0, 1, 3) and bm.num_cached == 0
    bm.check_invariants()


def test_eviction_is_lru_and_only_when_blank_blocks_run_out() -> None:
    bm = BlockManager(6, BS, enable_prefix_cache=True)
    computed(bm, 1, toks(8, start=0))  # blocks 0, 1
    computed(bm, 2, toks(8, start=50))  # blocks 2, 3
    bm.free(1)  # evictable: 1, 0
    bm.free(2)  # evictable: 1, 0, 3, 2
    assert list(bm._evictable) == [1, 0, 3, 2] and bm.num_free == 2
    assert bm.allocate(3, 8)  # blank blocks first: no eviction
    assert bm.block_table(3) == (4, 5) and bm.num_evictions == 0
    assert bm.allocate(3, 16)  # now the two least recently used cached blocks go
    assert bm.block_table(3) == (4, 5, 1, 0) and bm.num_evictions == 2
    assert bm.lookup(toks(9)) == []  # block 0 (the head) is gone
    assert bm.lookup(toks(9, start=50)) == [2, 3]
    bm.check_invariants()


def test_revived_blocks_count_against_what_is_left() -> None:
    bm = BlockManager(3, BS, enable_prefix_cache=True)
    computed(bm, 1, toks(8))
    bm.free(1)  # 2 cached, 1 blank
    prefix = bm.lookup(toks(12))
    assert prefix == [0, 1]
    assert not bm.allocate(2, 16, prefix)  # needs 2 more, only 1 blank (the cached ones are the prefix)
    assert bm.ref_counts == [0, 0, 0] and bm.num_cached == 2
    assert bm.allocate(2, 12, prefix)
    assert bm.block_table(2) == (0, 1, 2)
    bm.check_invariants()


def test_a_block_computed_twice_is_indexed_once() -> None:
    bm = BlockManager(8, BS, enable_prefix_cache=True)
    computed(bm, 1, toks(6))
    computed(bm, 2, toks(6))
    assert bm.block_table(1) == (0, 1) and bm.block_table(2) == (2, 3)
    assert bm.lookup(toks(6)) == [0]
    bm.free(2)
    assert bm.num_cached == 0 and bm.num_free == 6  # the duplicate went back blank
    bm.free(1)
    assert bm.num_cached == 1
    bm.check_invariants()


def test_chain_continues_after_a_duplicate_block() -> None:
    bm = BlockManager(8, BS, enable_prefix_cache=True)
    computed(bm, 1, toks(4))  # block 0 indexed
    computed(bm, 2, toks(9))  # its block 1 (a copy of 0's content) stays unindexed, block 2 is indexed
    assert bm.lookup(toks(9)) == [0, 2]
    bm.check_invariants()


def test_prefix_cache_off_indexes_nothing() -> None:
    bm = BlockManager(4, BS, enable_prefix_cache=False)
    computed(bm, 1, toks(8))
    assert bm.lookup(toks(9)) == []
    bm.free(1)
    assert bm.num_cached == 0 and bm.num_free == 4
    bm.check_invariants()


def test_release_behind_a_window_keeps_positions_and_the_last_block() -> None:
    bm = BlockManager(8, BS, enable_prefix_cache=True)
    assert bm.allocate(0, 5 * BS)
    computed(bm, 0, toks(5 * BS))
    table = bm.block_table(0)
    assert bm.release_behind(0, 2 * BS + 1) == 2  # blocks 0, 1 lie wholly before position 2*BS+1
    assert bm.num_held(0) == 3 and bm.num_cached == 2 and bm.num_used == 3
    assert bm.block_table(0) == (table[4], table[4], *table[2:])  # released slots show the last block
    assert bm.release_behind(0, 2 * BS + 1) == 0  # idempotent
    assert bm.release_behind(0, 100 * BS) == 2  # never the last block
    assert bm.num_held(0) == 1
    assert bm.allocate(0, 6 * BS) and bm.block_table(0)[5] not in table[4:]  # grows past the released slots
    assert bm.lookup(toks(5 * BS))[:2] == list(table[:2])  # released full blocks stay prefix hits
    bm.free(0)
    bm.check_invariants()
    assert bm.num_used == 0 and bm.num_free + bm.num_cached == 8


class BlockManagerMachine(RuleBasedStateMachine):
    """Random sequences (small alphabet, so prefixes collide) grow, compute, hit and free.

    A shadow map of each block's written content checks that every lookup hit holds
    exactly the tokens it is indexed under, through reuse and eviction."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(10, BS, enable_prefix_cache=True)
        self.bm.publish_events()
        self.live: set[int] = set()  # the indexed blocks as the events tell them (tl/core/kv_events.py)
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.content: dict[int, tuple[int, ...]] = {}
        self.next_id = 0

    def _write(self, seq_id: int, upto: int) -> None:
        table, toks_ = self.bm.block_table(seq_id), self.tokens[seq_id]
        for i in range(self.computed[seq_id] // BS, -(-upto // BS)):
            self.content[table[i]] = tuple(toks_[i * BS : min(upto, (i + 1) * BS)])
        self.computed[seq_id] = upto
        self.bm.cache_blocks(seq_id, toks_, upto)

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def start(self, prompt: list[int]) -> None:
        prefix = self.bm.lookup(prompt)
        for i, block in enumerate(prefix):
            assert self.content[block] == tuple(prompt[i * BS : (i + 1) * BS]), "a hit holds other tokens"
        seq_id, self.next_id = self.next_id, self.next_id + 1
        if self.bm.allocate(seq_id, len(prompt), prefix):
            self.tokens[seq_id], self.computed[seq_id] = list(prompt), len(prefix) * BS
            self._write(seq_id, len(prompt))

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data(), more=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def grow(self, data: st.DataObject, more: list[int]) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.bm.allocate(seq_id, len(self.tokens[seq_id]) + len(more)):
            self.tokens[seq_id] += more
            self._write(seq_id, len(self.tokens[seq_id]))

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq_id)
        del self.tokens[seq_id], self.computed[seq_id]

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def release_behind(self, data: st.DataObject) -> None:
        """A sliding window passes: blocks wholly before it are released (to the cache if indexed)."""
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        position = data.draw(st.integers(0, self.computed[seq_id]))
        before, gone = self.bm.block_table(seq_id), len(self.bm.block_table(seq_id)) - self.bm.num_held(seq_id)
        self.bm.release_behind(seq_id, position)
        after = self.bm.block_table(seq_id)
        assert len(after) == len(before) and after[position // BS :] == before[position // BS :]
        assert self.bm.num_held(seq_id) == len(before) - max(gone, min(position // BS, len(before) - 1))

    @invariant()
    def books_balance(self) -> None:
        self.bm.check_invariants()
        if not self.tokens:
            assert self.bm.num_used == 0 and self.bm.num_free + self.bm.num_cached == self.bm.num_blocks

    @invariant()
    def events_replayed_are_the_index(self) -> None:
        for e in self.bm.take_events():
            if isinstance(e, BlockStored):
                assert e.block_hash == chain_hash(e.parent_hash, e.token_ids) and e.block_hash not in self.live
                self.live.add(e.block_hash)
            else:
                self.live.remove(e.block_hash)
        assert self.live == set(self.bm._ext_of.values()) and len(self.live) == len(self.bm._key_of)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
