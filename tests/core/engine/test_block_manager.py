"""BlockManager: prefix sharing, all-or-nothing allocation, state slots."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrunner.engine.block_manager import BlockManager
from kvrunner.engine.block_pool import NoFreeBlocksError
from kvrunner.engine.sequence import Sequence
from kvrunner.engine.state_slots import NoFreeStateSlotError

BS = 4


def run_prefill(bm: BlockManager, seq: Sequence) -> None:
    """Admit ``seq`` and compute its whole prompt, as a step would."""
    bm.allocate(seq)
    bm.mark_computed(seq, seq.num_tokens - seq.num_computed_tokens)


def snapshot(bm: BlockManager, *seqs: Sequence) -> tuple:
    pool = bm.pool
    return (
        pool.num_free,
        [pool.ref_count(b) for b in range(pool.num_blocks)],
        [pool.block_hash(b) for b in range(pool.num_blocks)],
        bm.num_free_state_slots,
        [(list(s.block_table), s.num_computed_tokens, s.state_slot) for s in seqs],
    )


tokens = st.lists(st.integers(0, 50), min_size=BS, max_size=BS)


@given(
    shared=st.lists(tokens, min_size=1, max_size=3),
    tail_a=st.lists(st.integers(51, 99), min_size=1, max_size=2 * BS),
    tail_b=st.lists(st.integers(100, 150), min_size=1, max_size=2 * BS),
)
def test_a_shared_prefix_of_k_full_blocks_maps_the_same_k_physical_blocks(
    shared: list[list[int]], tail_a: list[int], tail_b: list[int]
) -> None:
    k = len(shared)
    prefix = [t for block in shared for t in block]
    bm = BlockManager(num_blocks=32, block_size=BS)
    a = Sequence(0, prefix + tail_a)
    run_prefill(bm, a)
    b = Sequence(1, prefix + tail_b)
    bm.allocate(b)

    # The tails differ from their first token, so exactly the k prefix blocks match.
    assert b.num_computed_tokens == k * BS
    assert b.block_table[:k] == a.block_table[:k]
    assert not set(b.block_table[k:]) & set(a.block_table)
    for block in a.block_table[:k]:
        assert bm.pool.ref_count(block) == 2


@pytest.mark.parametrize(
    ("num_tokens", "expected_hit"),
    [
        (3 * BS, 2 * BS),  # fully cached and block-aligned: the last block is recomputed
        (3 * BS + 1, 3 * BS),  # the lone last token is left to compute
        (1, 0),
    ],
)
def test_a_fully_cached_prompt_still_leaves_a_token_to_compute(
    num_tokens: int, expected_hit: int
) -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(num_tokens))
    run_prefill(bm, Sequence(0, prompt))
    again = Sequence(1, prompt)
    assert bm.num_cached_tokens(again) == expected_hit
    bm.allocate(again)
    assert again.num_computed_tokens == expected_hit
    assert again.num_uncomputed_tokens >= 1


def test_a_freed_prefix_is_revived_and_its_tail_is_evicted_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = Sequence(0, list(range(3 * BS + 1)))
    run_prefill(bm, a)  # 4 blocks, the first 3 published
    bm.free(a)
    assert bm.num_free_blocks == 4 and a.block_table == [] and a.num_computed_tokens == 0

    # A newcomer needing two blocks takes a's uncached partial block, then evicts a's
    # *last* cached block rather than its head.
    other = Sequence(1, [99] * (BS + 1))
    bm.allocate(other)
    assert bm.num_cached_tokens(Sequence(2, list(range(3 * BS + 1)))) == 2 * BS

    # Reviving the two surviving cached blocks costs free blocks too: a resubmitted
    # prompt that needs 2 revived + 2 fresh blocks does not fit in the 2 free ones.
    again = Sequence(3, list(range(3 * BS + 1)))
    assert not bm.can_allocate(again)
    bm.free(other)
    assert bm.can_allocate(again)
    bm.allocate(again)
    assert again.num_computed_tokens == 2 * BS and bm.num_free_blocks == 0


@given(
    num_blocks=st.integers(1, 6),
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=3 * BS), max_size=6),
    chunk_frac=st.floats(0.0, 1.0),
)
def test_can_allocate_predicts_allocate_exactly_and_failure_changes_nothing(
    num_blocks: int, prompts: list[list[int]], chunk_frac: float
) -> None:
    bm = BlockManager(num_blocks=num_blocks, block_size=BS)
    held: list[Sequence] = []
    for i, prompt in enumerate(prompts):
        seq = Sequence(i, prompt)
        remaining = seq.num_tokens - bm.num_cached_tokens(seq)
        n = max(1, round(chunk_frac * remaining))
        before = snapshot(bm, seq, *held)
        if bm.can_allocate(seq, n):
            bm.allocate(seq, n)
            assert len(seq.block_table) * BS >= seq.num_computed_tokens + n
            bm.mark_computed(seq, n)
            held.append(seq)
        else:
            with pytest.raises(NoFreeBlocksError):
                bm.allocate(seq, n)
            assert snapshot(bm, seq, *held) == before
        if i % 2 and held:  # release some, so later prompts hit free cached blocks
            bm.free(held.pop(0))
    for seq in held:
        bm.free(seq)
    assert bm.num_free_blocks == num_blocks


def test_ensure_slots_grows_exactly_as_needed_and_refuses_without_side_effects() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS, enable_prefix_caching=False)
    seq = Sequence(0, list(range(4 * BS)))
    bm.allocate(seq, num_new_tokens=BS)
    assert len(seq.block_table) == 1
    bm.mark_computed(seq, BS)
    assert bm.ensure_slots(seq, 1) and len(seq.block_table) == 2
    assert bm.ensure_slots(seq, BS) and len(seq.block_table) == 2  # still fits
    before = snapshot(bm, seq)
    assert not bm.ensure_slots(seq, 3 * BS)  # would need 4 blocks in all
    assert snapshot(bm, seq) == before
    with pytest.raises(ValueError, match="exceed its 2 blocks"):
        bm.mark_computed(seq, BS + 1)  # KV with nowhere to live
    with pytest.raises(ValueError, match="cannot mark"):
        bm.mark_computed(seq, 4 * BS)  # more tokens than the sequence has
    assert snapshot(bm, seq) == before


def test_only_full_computed_blocks_are_published() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = Sequence(0, list(range(2 * BS + 2)))
    bm.allocate(seq, num_new_tokens=BS - 1)
    bm.mark_computed(seq, BS - 1)
    assert bm.pool.num_cached == 0  # block 0 is not full yet
    assert bm.ensure_slots(seq, BS + 3)
    bm.mark_computed(seq, BS + 3)  # 2 * BS + 2 computed: blocks 0 and 1 full
    assert [bm.pool.block_hash(b) is not None for b in seq.block_table] == [True, True, False]


def test_state_slots_are_handed_out_per_running_sequence_and_disable_prefix_caching() -> None:
    bm = BlockManager(num_blocks=9, block_size=BS, enable_prefix_caching=True, num_state_slots=2)
    assert not bm.enable_prefix_caching
    prompt = list(range(2 * BS + 1))
    a, b, c = (Sequence(i, prompt) for i in range(3))
    run_prefill(bm, a)
    bm.allocate(b)
    assert b.num_computed_tokens == 0  # no hit although a computed the same prompt
    assert {a.state_slot, b.state_slot} == {0, 1}
    assert not set(a.block_table) & set(b.block_table)

    assert bm.num_free_blocks >= 3 and not bm.can_allocate(c)  # blocks, but no slot
    before = snapshot(bm, a, b, c)
    with pytest.raises(NoFreeStateSlotError):
        bm.allocate(c)
    assert snapshot(bm, a, b, c) == before

    slot = a.state_slot
    bm.free(a)
    assert a.state_slot == -1 and bm.num_free_state_slots == 1
    bm.allocate(c)
    assert c.state_slot == slot


def test_without_state_slots_sequences_hold_none() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = Sequence(0, [1, 2, 3])
    bm.allocate(seq)
    assert seq.state_slot == -1 and bm.num_state_slots == 0


def test_reset_prefix_cache_forgets_every_prefix() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(2 * BS + 1))
    a = Sequence(0, prompt)
    run_prefill(bm, a)
    assert bm.num_cached_tokens(Sequence(1, prompt)) == 2 * BS
    assert bm.reset_prefix_cache() == 2
    assert bm.num_cached_tokens(Sequence(2, prompt)) == 0
    bm.free(a)
    assert bm.num_free_blocks == 8


def test_a_sequence_holding_blocks_at_a_reset_publishes_no_block_after_it() -> None:
    """Its KV is stale (the reset follows a weight update), and so is every block it
    fills on top of that KV; a sequence admitted after the reset publishes as usual."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(BS + 2))
    held = Sequence(0, prompt)
    run_prefill(bm, held)
    bm.reset_prefix_cache()
    held.token_ids += [90, 91, 92, 93]  # decoded on top of the stale KV
    bm.ensure_slots(held, 4)
    bm.mark_computed(held, 4)  # fills block 1, over stale context
    assert [bm.pool.block_hash(b) for b in held.block_table] == [None, None, None]
    fresh = Sequence(1, held.token_ids)  # the same tokens, computed after the reset
    run_prefill(bm, fresh)
    longer = Sequence(2, held.token_ids + [7])
    bm.allocate(longer)
    assert longer.num_computed_tokens == 2 * BS
    assert longer.block_table[:2] == fresh.block_table[:2]  # fresh's KV, not held's


def test_allocate_refuses_a_sequence_that_already_holds_blocks() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = Sequence(0, [1, 2])
    bm.allocate(seq)
    with pytest.raises(ValueError, match="already holds"):
        bm.allocate(seq)
