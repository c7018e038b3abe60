"""Prefix-cache salts: requests share cached blocks exactly when their tokens and their
salts (the caller's ``cache_salt``, and the weight version they were admitted under
when the engine salts by it) are equal."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrunner.engine.block_manager import BlockManager
from kvrunner.engine.block_pool import hash_block_tokens
from kvrunner.engine.cache_salt import check_cache_salt, salt_bytes
from kvrunner.engine.sequence import Sequence
from kvrunner.errors import RequestError

BS = 4
salts = st.none() | st.text(min_size=1, max_size=12)
versions = st.none() | st.integers(-3, 1000) | st.text(max_size=6)
blocks = st.lists(st.integers(0, 50), min_size=2 * BS, max_size=4 * BS)


def _admitted(manager: BlockManager, seq_id: int, tokens: list[int], salt: str | None) -> Sequence:
    """A sequence admitted (taking whatever the prefix cache holds) and fully computed,
    so its full blocks are published."""
    seq = Sequence(seq_id, tokens, cache_salt=salt)
    manager.allocate(seq)
    manager.mark_computed(seq, seq.num_tokens - seq.num_computed_tokens)
    return seq


def _hits(manager: BlockManager, tokens: list[int], salt: str | None) -> int:
    return manager.num_cached_tokens(Sequence(99, tokens, cache_salt=salt))


@given(salt=salts, version=versions, other_salt=salts, other_version=versions)
def test_salt_bytes_equal_only_for_equal_parts(salt, version, other_salt, other_version):
    same = (salt, type(version), version) == (other_salt, type(other_version), other_version)
    assert (salt_bytes(salt, version) == salt_bytes(other_salt, other_version)) == same


def test_no_part_is_mistaken_for_another():
    # a caller's salt never lands in a weight version's namespace, nor 7 in "7"'s
    assert salt_bytes("7", None) != salt_bytes(None, "7")
    assert salt_bytes(None, 7) != salt_bytes(None, "7")
    assert salt_bytes("a", "b") != salt_bytes("ab", None) != salt_bytes(None, "ab")
    assert salt_bytes(None, None) is None


@given(tokens=st.lists(st.integers(0, 2**40), min_size=1, max_size=8), salt=salts, other=salts)
def test_first_block_hash_differs_exactly_when_the_salt_does(tokens, salt, other):
    as_bytes = None if salt is None else salt.encode()
    other_bytes = None if other is None else other.encode()
    same = hash_block_tokens(None, tokens, as_bytes) == hash_block_tokens(None, tokens, other_bytes)
    assert same == (salt == other)


def test_a_salt_enters_the_first_block_only():
    with pytest.raises(ValueError, match="first block"):
        hash_block_tokens(12345, [1, 2, 3], b"salt")


@given(tokens=blocks, salt=salts)
def test_equal_tokens_and_equal_salt_share_every_full_block(tokens, salt):
    manager = BlockManager(num_blocks=16, block_size=BS)
    _admitted(manager, 0, tokens, salt)
    assert _hits(manager, tokens, salt) == (len(tokens) - 1) // BS * BS


@given(tokens=blocks, salt=salts, other=salts)
def test_different_salts_never_share_a_block(tokens, salt, other):
    manager = BlockManager(num_blocks=16, block_size=BS)
    first = _admitted(manager, 0, tokens, salt)
    second = _admitted(manager, 1, tokens, other)
    if salt != other:
        assert second.num_cached_tokens == 0
        assert not set(first.block_table) & set(second.block_table)
        assert manager.pool.num_cached == 2 * (len(tokens) // BS)
    else:
        assert second.num_cached_tokens == (len(tokens) - 1) // BS * BS


@given(tokens=blocks, salt=salts)
def test_salted_by_version_a_request_after_an_update_hits_nothing_before_it(tokens, salt):
    manager = BlockManager(num_blocks=32, block_size=BS, salt_by_weight_version=True)
    _admitted(manager, 0, tokens, salt)
    assert _hits(manager, tokens, salt) > 0  # same version: shared
    manager.weight_version = "step-2"  # the prefix cache is not reset
    assert _hits(manager, tokens, salt) == 0
    _admitted(manager, 1, tokens, salt)
    assert _hits(manager, tokens, salt) == (len(tokens) - 1) // BS * BS


def test_unsalted_by_version_an_unreset_cache_is_hit_across_an_update():
    """The stale reuse the salt prevents: without it, KV of the old weights is a hit."""
    tokens = list(range(3 * BS))
    manager = BlockManager(num_blocks=16, block_size=BS, salt_by_weight_version=False)
    _admitted(manager, 0, tokens, None)
    manager.weight_version = 1
    assert _hits(manager, tokens, None) == 2 * BS


def test_a_running_sequence_keeps_the_version_it_was_admitted_under():
    """Blocks a sequence fills after an update attend to KV of the old weights: they are
    published in the old version's namespace, where no later request looks."""
    manager = BlockManager(num_blocks=16, block_size=BS, salt_by_weight_version=True)
    tokens = list(range(3 * BS))
    seq = Sequence(0, tokens)
    manager.allocate(seq, BS)
    manager.mark_computed(seq, BS)  # block 0 computed under version 0
    manager.weight_version = 1
    assert manager.ensure_slots(seq, 2 * BS)
    manager.mark_computed(seq, 2 * BS)  # blocks 1 and 2 published now
    assert manager.pool.num_cached == 3
    assert _hits(manager, tokens, None) == 0
    manager.weight_version = 0  # only a request admitted under version 0 would see them
    assert _hits(manager, tokens, None) == 2 * BS


def test_a_preempted_sequence_is_rekeyed_when_readmitted_under_new_weights():
    manager = BlockManager(num_blocks=16, block_size=BS, salt_by_weight_version=True)
    tokens = list(range(3 * BS))
    seq = _admitted(manager, 0, tokens, "tenant")
    old = list(seq.block_hashes)
    manager.free(seq)  # preempted
    manager.weight_version = 5
    manager.allocate(seq)
    assert seq.num_computed_tokens == 0  # its own old blocks are no hit
    manager.mark_computed(seq, seq.num_tokens)
    assert seq.block_hashes and not set(seq.block_hashes) & set(old)


@pytest.mark.parametrize("bad", ["", 7, b"x", ["a"]])
def test_a_bad_cache_salt_is_refused_by_name(bad):
    with pytest.raises(RequestError, match="request 3: cache_salt must be a non-empty string"):
        check_cache_salt(bad, "request 3")
