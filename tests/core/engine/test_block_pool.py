"""BlockPool: reference counts, the prefix cache, and LRU eviction of free cached blocks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvrunner.engine.block_pool as block_pool_module
from kvrunner.engine.block_pool import BlockPool, NoFreeBlocksError, hash_block_tokens


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate/ref/free/cache/revive against an explicit model of the pool."""

    NUM_BLOCKS = 3

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.NUM_BLOCKS, block_size=4)
        self.held: dict[int, int] = {}  # block -> ref count (> 0)
        self.free_plain: set[int] = set(range(self.NUM_BLOCKS))
        self.free_cached: list[int] = []  # oldest freed first
        self.hash_of: dict[int, int] = {}  # block -> prefix hash
        self.next_hash = 1

    @precondition(lambda self: self.free_plain or self.free_cached)
    @rule()
    def allocate(self) -> None:
        block = self.pool.allocate()
        if self.free_plain:
            # Cached contents are only sacrificed when no plain free block is left.
            assert block in self.free_plain
            self.free_plain.remove(block)
        else:
            assert block == self.free_cached.pop(0), "evicted a block that is not the LRU one"
            del self.hash_of[block]
        self.held[block] = 1

    @precondition(lambda self: not self.free_plain and not self.free_cached)
    @rule()
    def allocate_from_empty_pool(self) -> None:
        with pytest.raises(NoFreeBlocksError):
            self.pool.allocate()

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def add_holder(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.held)))
        self.pool.ref(block)
        self.held[block] += 1

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.held)))
        self.pool.free(block)
        self.held[block] -= 1
        if self.held[block] == 0:
            del self.held[block]
            if block in self.hash_of:
                self.free_cached.append(block)
            else:
                self.free_plain.add(block)

    @precondition(lambda self: len(self.held) < self.NUM_BLOCKS)
    @rule(data=st.data())
    def free_a_free_block_is_refused(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(set(range(self.NUM_BLOCKS)) - set(self.held))))
        with pytest.raises(ValueError, match="freed more times"):
            self.pool.free(block)

    @precondition(lambda self: self.free_plain)
    @rule(data=st.data())
    def sharing_a_plain_free_block_is_refused(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.free_plain)))
        with pytest.raises(ValueError, match="holds no cached prefix"):
            self.pool.ref(block)

    @precondition(lambda self: any(b not in self.hash_of for b in self.held))
    @rule(data=st.data())
    def publish(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(b for b in self.held if b not in self.hash_of)))
        assert self.pool.cache_full_block(block, self.next_hash)
        self.hash_of[block] = self.next_hash
        self.next_hash += 1

    @precondition(lambda self: self.hash_of and any(b not in self.hash_of for b in self.held))
    @rule(data=st.data())
    def publish_a_duplicate_prefix_keeps_the_first(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(b for b in self.held if b not in self.hash_of)))
        taken = data.draw(st.sampled_from(sorted(self.hash_of.values())))
        assert not self.pool.cache_full_block(block, taken)

    @precondition(lambda self: self.free_cached)
    @rule(data=st.data())
    def revive_by_prefix_hit(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(self.free_cached))
        assert self.pool.lookup(self.hash_of[block]) == block
        self.pool.ref(block)
        self.free_cached.remove(block)
        self.held[block] = 1

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.pool.reset_prefix_cache() == len(self.hash_of)
        self.hash_of.clear()
        self.free_plain.update(self.free_cached)
        self.free_cached.clear()

    @invariant()
    def no_block_lost_or_double_counted(self) -> None:
        assert self.pool.num_free == len(self.free_plain) + len(self.free_cached)
        assert self.pool.num_free + len(self.held) == self.NUM_BLOCKS
        for block in range(self.NUM_BLOCKS):
            assert self.pool.ref_count(block) == self.held.get(block, 0)

    @invariant()
    def cache_matches_model(self) -> None:
        assert self.pool.num_cached == len(self.hash_of)
        for block, block_hash in self.hash_of.items():
            assert self.pool.lookup(block_hash) == block
            assert self.pool.block_hash(block) == block_hash


TestBlockPoolStateMachine = BlockPoolMachine.TestCase


def test_cached_blocks_are_evicted_only_when_plain_free_blocks_run_out_oldest_first() -> None:
    pool = BlockPool(4, block_size=2)
    a, b, c, d = (pool.allocate() for _ in range(4))
    for block, h in ((a, 10), (b, 11), (c, 12)):
        pool.cache_full_block(block, h)
    for block in (b, a, c, d):  # freed in this order; d is plain
        pool.free(block)
    assert pool.num_free == 4

    assert pool.allocate() == d  # the plain block first: every prefix survives
    assert [pool.lookup(h) for h in (10, 11, 12)] == [a, b, c]
    assert pool.allocate() == b  # then the oldest-freed cached block
    assert pool.lookup(11) is None and pool.block_hash(b) is None
    pool.ref(a)  # a prefix hit revives a: it is no longer evictable
    assert pool.allocate() == c
    assert pool.lookup(10) == a and pool.num_free == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()


def test_a_block_cannot_change_prefix_while_cached() -> None:
    pool = BlockPool(2, block_size=2)
    block = pool.allocate()
    assert pool.cache_full_block(block, 7)
    assert pool.cache_full_block(block, 7)  # idempotent
    with pytest.raises(ValueError, match="another prefix"):
        pool.cache_full_block(block, 8)
    pool.free(block)
    with pytest.raises(ValueError, match="only a held block"):
        pool.cache_full_block(block, 9)


def test_block_hash_chains_over_the_whole_prefix() -> None:
    root = hash_block_tokens(None, [1, 2, 3, 4])
    assert root == hash_block_tokens(None, (1, 2, 3, 4))
    assert root != hash_block_tokens(None, [4, 3, 2, 1])
    child = hash_block_tokens(root, [5, 6, 7, 8])
    # Same tokens under another parent are another prefix.
    assert child != hash_block_tokens(hash_block_tokens(None, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert child != hash_block_tokens(None, [5, 6, 7, 8])
    assert 0 <= child < 1 << 128


def test_block_hash_is_the_same_in_another_process_with_another_hash_seed() -> None:
    here = hash_block_tokens(hash_block_tokens(None, [11, 22]), [33, 44])
    script = (
        "import runpy, sys; m = runpy.run_path(sys.argv[1]); h = m['hash_block_tokens'];"
        "print(h(h(None, [11, 22]), [33, 44]))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", script, str(Path(block_pool_module.__file__))],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    assert int(out.stdout) == here
