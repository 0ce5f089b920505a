"""KV block manager: which KV-cache blocks each sequence holds, their reference counts, and
the prefix cache of full blocks.

Owns: the block ids 0..num_blocks-1 and their three states (free: blank; used: referenced
by >= 1 block table; cached: unreferenced but indexed for prefix reuse, evictable), the
per-sequence block tables, the prefix index, and for models whose every layer attends through
a sliding window the release of blocks a sequence has left behind it. Knows nothing about requests, budgets or
the runner: the scheduler decides *when* to allocate, free and cache; this module keeps
the books exact. Pure Python, no jax/numpy. Tested by tests/core/test_block_manager.py (exact
ids, refcounts, eviction order; a hypothesis state machine checks `check_invariants`).

Prefix cache ("radix"): a full block whose KV is computed is indexed by the key
(parent_hash, its block_size tokens), where parent_hash is the chain hash (hash of the
parent's key) of the block before it, ROOT_HASH for the first. The keys form a trie of
blocks (each names its parent), so a lookup walks a prompt block by block from the root
and stops at the first miss. Eviction drops one key; its descendants become unreachable
and age out of the LRU on their own (sequences free their tails first, so tails are
older and go first). Two sequences that compute the same block concurrently index it once;
the other copy stays unindexed and is returned blank.

Sliding windows (`release_behind`): where every layer of the model sees only its last W
positions (Mistral v0.1: W = 4096), a block whose positions all lie before the window of the
sequence's next token is never read again, and is released at once (to the prefix cache if
indexed, else blank): a sequence then holds about W / block_size + 1 blocks whatever its
length. Its table keeps the slot (`RELEASED`), so position p stays in table[p // block_size];
`block_table` shows a released slot as the sequence's last block (a valid id the attention
kernels mask: they never read keys behind a window). Where some layers attend globally
(Gemma 3: one layer in six) every block stays needed by them, since all layers share one
block table; giving the sliding layers a cache of their own (as vLLM's hybrid allocator
does) would bound their part: for Gemma 3 270M (18 layers, 15 sliding, window 512, 36,864
bytes of float32 KV a token) a 32k-token sequence holds 1.13 GiB, of which 0.94 GiB are the
sliding layers' keys outside their window. Not built: tl keeps one table.

Events (`publish_events`): while on, each block indexed is a BlockStored and each indexed block
evicted a BlockRemoved, in `events` until the engine takes them, named by tl/core/kv_events.py's
documented chain hash (kept per sequence beside the index's own chain, and per indexed block).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from tl.core.kv_events import BlockRemoved, BlockStored, KVEvent, chain_hash

BlockKey = tuple[int, tuple[int, ...]]
"""(chain hash of the parent block, the block's token ids)."""

ROOT_HASH = 0
RELEASED = -1
"""A table slot whose block was released behind a sliding window."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # blank, FIFO: freed blocks go last
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._key_of: dict[int, BlockKey] = {}  # indexed block -> its key
        self._index: dict[BlockKey, int] = {}  # key -> indexed block
        self._tables: dict[int, list[int]] = {}  # seq id -> block ids, position p in table[p // block_size]
        self._chains: dict[int, list[int]] = {}  # seq id -> chain hashes of its leading computed full blocks
        self._released: dict[int, int] = {}  # seq id -> its table's leading RELEASED slots (absent: none)
        self.events: list[KVEvent] = []  # since the engine last took them (only while publishing)
        self._publishing = False
        self._ext_chains: dict[int, list[int]] = {}  # seq id -> documented hashes of its chain's blocks
        self._ext_of: dict[int, int] = {}  # indexed block -> its documented hash
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blank blocks (not counting evictable cached ones)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced indexed blocks, reusable by a prefix hit or evictable."""
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) - len(self._evictable)

    def block_table(self, seq_id: int) -> tuple[int, ...]:
        """seq's block ids by position; a released slot shows the table's last block (never read)."""
        table = self._tables.get(seq_id, [])
        gone = self._released.get(seq_id, 0)
        return (table[-1],) * gone + tuple(table[gone:]) if gone else tuple(table)

    def num_held(self, seq_id: int) -> int:
        """Blocks seq holds (its table less the released slots)."""
        return len(self._tables.get(seq_id, ())) - self._released.get(seq_id, 0)

    def release_behind(self, seq_id: int, position: int) -> int:
        """Release seq's blocks that lie wholly before `position` (the first position any of
        its future tokens can still attend to); returns how many were released. Indexed blocks
        go to the prefix cache, the rest back blank; the table's last block always stays."""
        table = self._tables.get(seq_id)
        if not table:
            return 0
        start, end = self._released.get(seq_id, 0), min(max(position, 0) // self.block_size, len(table) - 1)
        for i in range(start, end):  # released slots are a prefix: each step looks at new ones only
            self._unref(table[i])
            table[i] = RELEASED
        if end > start:
            self._released[seq_id] = end
        return max(0, end - start)

    def publish_events(self) -> None:
        """From now on, record BlockStored / BlockRemoved events (before any sequence runs)."""
        assert not self._tables, "events are turned on before the first sequence"
        self._publishing = self.enable_prefix_cache

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def _unref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self._key_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def lookup(self, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks holding the longest indexed prefix of token_ids; no side effects.

        At most (len - 1) // block_size blocks, so the last token is always computed (the
        runner needs a position to sample from) and no shared block is ever written.
        """
        if not self.enable_prefix_cache:
            return []
        blocks: list[int] = []
        parent = ROOT_HASH
        for i in range((len(token_ids) - 1) // self.block_size):
            key = (parent, tuple(token_ids[i * self.block_size : (i + 1) * self.block_size]))
            block = self._index.get(key)
            if block is None:
                break
            blocks.append(block)
            parent = hash(key)
        return blocks

    def allocate(self, seq_id: int, num_tokens: int, prefix_blocks: Sequence[int] = ()) -> bool:
        """Grow seq's table to cover positions 0..num_tokens-1, all or nothing.

        prefix_blocks (from `lookup`, only for a sequence holding no blocks yet) are shared
        first. Returns False, changing nothing, if blank plus evictable blocks do not suffice.
        """
        table = self._tables.get(seq_id, [])
        assert not prefix_blocks or not table, "prefix blocks only for a sequence without blocks"
        num_needed = -(-num_tokens // self.block_size) - len(table) - len(prefix_blocks)
        revived = sum(1 for b in prefix_blocks if self.ref_counts[b] == 0)
        if num_needed > len(self._free) + len(self._evictable) - revived:
            return False
        for block in prefix_blocks:
            self._share(block)
        table.extend(prefix_blocks)
        table.extend(self._take_blank() for _ in range(num_needed))
        self._tables[seq_id] = table
        if seq_id not in self._chains:
            self._chains[seq_id] = [hash(self._key_of[b]) for b in prefix_blocks]
            if self._publishing:
                self._ext_chains[seq_id] = [self._ext_of[b] for b in prefix_blocks]
        return True

    def cache_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Index seq's full blocks whose KV is computed (positions < num_computed_tokens)."""
        if not self.enable_prefix_cache:
            return
        chain, table, bs = self._chains[seq_id], self._tables[seq_id], self.block_size
        ext = self._ext_chains.setdefault(seq_id, []) if self._publishing else None
        for i in range(len(chain), num_computed_tokens // bs):
            key = (chain[-1] if chain else ROOT_HASH, tuple(token_ids[i * bs : (i + 1) * bs]))
            chain.append(hash(key))
            block = table[i]
            indexed = block != RELEASED and key not in self._index and block not in self._key_of
            if indexed:
                self._index[key] = block
                self._key_of[block] = key
            if ext is not None:
                parent = ext[-1] if ext else None
                ext.append(chain_hash(parent, key[1]))
                if indexed:
                    self._ext_of[block] = ext[-1]
                    self.events.append(BlockStored(ext[-1], parent, key[1]))

    def free(self, seq_id: int) -> None:
        """Release all of seq's blocks, tail first, so its tail is evicted before its head."""
        self._chains.pop(seq_id, None)
        self._ext_chains.pop(seq_id, None)
        self._released.pop(seq_id, None)
        for block in reversed(self._tables.pop(seq_id, [])):
            if block != RELEASED:
                self._unref(block)

    def _share(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._evictable[block]
        self.ref_counts[block] += 1

    def _take_blank(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._index[self._key_of.pop(block)]
            self.num_evictions += 1
            if self._publishing:
                self.events.append(BlockRemoved(self._ext_of.pop(block)))
        self.ref_counts[block] = 1
        return block

    def check_invariants(self) -> None:
        """Raise AssertionError unless every block is in exactly one state and counts match tables."""
        counts = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            held = [b for b in table if b != RELEASED]
            assert len(set(held)) == len(held), f"seq {seq_id} holds a block twice: {table}"
            assert table[-1] != RELEASED and held == table[len(table) - len(held) :], f"seq {seq_id}: {table}"
            assert len(table) - len(held) == self._released.get(seq_id, 0), f"seq {seq_id}: released count"
            for block in held:
                counts[block] += 1
        assert counts == self.ref_counts, f"refcounts {self.ref_counts} != table counts {counts}"
        free, cached = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is free twice"
        assert not free & cached, f"blocks both free and cached: {free & cached}"
        for block in range(self.num_blocks):
            states = (block in free) + (block in cached) + (counts[block] > 0)
            assert states == 1, f"block {block} is in {states} states (lost or double-owned)"
        assert all(b in self._key_of for b in cached), "an evictable block is not indexed"
        assert not any(b in self._key_of for b in free), "a blank block is still indexed"
        assert all(self._index[k] == b for b, k in self._key_of.items()), "index and keys disagree"
        assert len(self._index) == len(self._key_of), "index and keys differ in size"
        assert set(self._chains) <= set(self._tables), "a chain outlived its table"
        assert set(self._released) <= set(self._tables), "a released count outlived its table"
        assert set(self._ext_chains) <= set(self._tables), "a documented chain outlived its table"
        assert set(self._ext_of) == (set(self._key_of) if self._publishing else set()), "documented hashes"
