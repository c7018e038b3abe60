"""Runner building blocks: forward_vars, sizing, blanking and the pool audit."""

from __future__ import annotations

import gc

import attrs
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from kvrunner import LLM
from kvrunner.layers.fused.dispatch import kernels_chosen
from kvrunner.plugin_api import CacheSpec, CacheWriteTarget
from kvrunner.runner.capture import capture_safety
from kvrunner.runner.capture.capture_safety import (
    CaptureAuditError,
    PoolSnapshot,
    blank_write_targets,
    seed_undeclared_index_buffers,
)
from kvrunner.runner.capture.graphs import default_capture_sizes, garbage_collection_paused
from kvrunner.runner.pools.cache_pools import CachePools
from kvrunner.runner.pools.pool_size import PoolSize
from kvrunner.runner.pools.sizing import (
    CacheSizingError,
    budget_from_memory,
    num_blocks_for_budget,
)
from kvrunner.runner.step.forward_vars import ForwardVars


def test_forward_vars_refuses_to_replace_a_buffer() -> None:
    fv = ForwardVars()
    buf = fv.register("slot_mapping", torch.zeros(4, dtype=torch.int64))
    with pytest.raises(KeyError, match="slot_mapping"):
        fv.register("slot_mapping", torch.zeros(4, dtype=torch.int64))
    assert fv["slot_mapping"] is buf
    assert fv.owns(buf[1:3]) and not fv.owns(torch.zeros(4))


@given(
    per_block=st.lists(st.integers(0, 4096), min_size=1, max_size=3).filter(any),
    per_slot=st.lists(st.integers(0, 4096), min_size=1, max_size=3),
    budget=st.integers(0, 1 << 22),
    slots=st.integers(1, 64),
)
def test_sizing_never_exceeds_the_budget_and_uses_it_up_to_one_block(
    per_block, per_slot, budget, slots
) -> None:
    specs = [CacheSpec(bytes_per_block=b) for b in per_block]
    specs += [CacheSpec(bytes_per_slot=s) for s in per_slot]
    block, slot = sum(per_block), sum(per_slot)
    try:
        n = num_blocks_for_budget(specs, budget_bytes=budget, num_slots=slots, min_blocks=1)
    except CacheSizingError as e:
        assert "need at least 1" in str(e)
        assert budget - slot * slots < block  # it really did not fit
        return
    used = n * block + slots * slot
    assert used <= budget < used + block


GiB = 1 << 30


def test_an_engine_budget_is_its_share_of_the_card_less_what_it_holds_itself() -> None:
    """As vLLM counts it: ``gpu_memory_utilization`` is this engine's share of the card;
    what the process held before the engine started (another engine, a trainer's
    tensors) is not charged to it while the card has the memory free."""
    card = dict(total=80 * GiB, utilization=0.3, peak_bytes=2 * GiB)
    alone = budget_from_memory(free=70 * GiB, reserved=10 * GiB, allocated=10 * GiB,
                               held_before=0, **card)
    assert alone == 24 * GiB - 10 * GiB - 2 * GiB
    beside = budget_from_memory(free=40 * GiB, reserved=40 * GiB, allocated=40 * GiB,
                                held_before=30 * GiB, **card)
    assert beside == alone  # the other engine's 30 GiB are its own
    # torch's cache (reserved, not allocated) is reusable and counts as free
    assert budget_from_memory(free=40 * GiB, reserved=45 * GiB, allocated=40 * GiB,
                              held_before=30 * GiB, **card) == alone


def test_an_engine_budget_never_exceeds_what_the_card_has_free() -> None:
    """Memory another process holds is never promised twice: the share is capped by
    the free memory (after the activation peak)."""
    budget = budget_from_memory(total=80 * GiB, free=5 * GiB, reserved=10 * GiB,
                                allocated=10 * GiB, held_before=0, utilization=0.9,
                                peak_bytes=2 * GiB)
    assert budget == 3 * GiB


def test_default_capture_sizes_are_powers_then_steps_of_16() -> None:
    assert default_capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert default_capture_sizes(3) == [1, 2, 3]


def test_blanking_fills_every_target_with_its_own_pad() -> None:
    a = torch.arange(6, dtype=torch.int64)
    b = torch.arange(4, dtype=torch.int32)
    blank_write_targets(
        [
            CacheWriteTarget(backend="x", name="a", buffer=a),
            CacheWriteTarget(backend="y", name="b", buffer=b, pad_value=0),
        ]
    )
    assert a.tolist() == [-1] * 6 and b.tolist() == [0] * 4


def test_audit_passes_untouched_pools_even_holding_nan() -> None:
    pool = torch.randn(3, 4)
    pool[1, 2] = float("nan")
    snapshot = PoolSnapshot({"p": pool})
    assert snapshot.require_unchanged(batch_size=1, blanked=[]) is None  # no error raised
    pool[1, 2] = 0.0  # the same snapshot sees a change: the pass above was not vacuous
    with pytest.raises(CaptureAuditError):
        snapshot.require_unchanged(batch_size=1, blanked=[])


@pytest.mark.parametrize("change", ["value", "nan", "negative_zero"])
def test_audit_names_the_pool_a_capture_wrote(change: str) -> None:
    pools = {"kv.0": torch.zeros(3, 4), "kv.1": torch.zeros(3, 4)}
    snap = PoolSnapshot(pools)
    pools["kv.1"][2, 1] = {"value": 1.0, "nan": float("nan"), "negative_zero": -0.0}[change]
    with pytest.raises(CaptureAuditError, match=r"batch size 8.*\['kv.1'\]"):
        snap.require_unchanged(batch_size=8, blanked=[])


@st.composite
def pools_and_a_change(draw: st.DrawFn) -> tuple[torch.Tensor, int, str]:
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8]))
    numel = draw(st.integers(1, 300))
    pool = torch.randint(-100, 100, (numel,)).to(dtype)
    return pool, draw(st.integers(0, numel - 1)), draw(st.sampled_from(["value", "swap"]))


@given(pools_and_a_change())
def test_checksums_see_any_changed_or_moved_element_across_chunk_edges(case) -> None:
    pool, index, change = case
    if change == "swap":
        other = (index + 1) % pool.numel()
        assume(pool[index] != pool[other])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(capture_safety, "CHUNK_WORDS", 8)  # many chunks, a partial last one
        mp.setattr(capture_safety, "GROUP_WORDS", 24)
        snap = PoolSnapshot({"p": pool})
        assert snap.changed_pools() == []  # unchanged bytes: same checksums
        if change == "value":
            pool[index] = pool[index] + 1
        else:  # two different elements trade places: the plain sum alone would miss it
            pool[index], pool[other] = pool[other].clone(), pool[index].clone()
        assert snap.changed_pools() == ["p"]


def test_seeding_fills_undeclared_integer_buffers_with_in_range_rows_only() -> None:
    declared = torch.full((6,), -1, dtype=torch.int64)
    undeclared = torch.zeros(2, 5, dtype=torch.int32)
    floats = torch.zeros(4)
    target = CacheWriteTarget(backend="x", name="slots", buffer=declared)
    seeded = seed_undeclared_index_buffers([declared, undeclared, floats], [target], bound=3)
    assert [s is undeclared for s in seeded] == [True]
    assert declared.tolist() == [-1] * 6 and floats.tolist() == [0.0] * 4
    assert undeclared.flatten().tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]


@given(st.integers(1, 200), st.sampled_from([torch.float32, torch.bfloat16, torch.uint8]))
def test_checksum_kernel_equals_the_torch_reference(numel: int, dtype: torch.dtype) -> None:
    pool = torch.randint(-1000, 1000, (numel,)).to(dtype)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(capture_safety, "CHUNK_WORDS", 16)
        with kernels_chosen(triton_on_cpu=False):
            reference = capture_safety.chunk_checksums(pool)
        with kernels_chosen(triton_on_cpu=True):
            assert torch.equal(capture_safety.chunk_checksums(pool), reference)


def test_garbage_collection_pauses_inside_and_comes_back_as_it_was() -> None:
    """The pause a CUDA graph capture runs under: off inside, and afterwards as before
    (on stays on, off stays off), also when the body raises."""
    assert gc.isenabled()
    with pytest.raises(RuntimeError), garbage_collection_paused():
        assert not gc.isenabled()
        raise RuntimeError("a failed capture")
    assert gc.isenabled()
    gc.disable()
    try:
        with garbage_collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_one_pool_size_is_shared_by_the_pools_the_reports_and_the_engine() -> None:
    with LLM("tiny-qwen3", max_num_seqs=2, max_model_len=64, enforce_eager=True) as llm:
        runner = llm.runner
        assert isinstance(runner.pool_size, PoolSize)
        assert runner.cache.size is runner.pool_size  # the one record, not a copy
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            runner.pool_size.num_blocks += 1
        info = llm.cache_info()
        assert info.num_blocks == runner.pool_size.num_blocks
        assert llm.engine.block_manager.num_blocks == runner.pool_size.num_blocks
        assert runner.pool_size.own_num_blocks >= runner.pool_size.num_blocks


def test_the_start_up_profile_pool_goes_through_cache_pools_and_is_released() -> None:
    with LLM("tiny-qwen3", max_num_seqs=2, max_model_len=64, enforce_eager=True) as llm:
        backends = llm.runner.backends
        llm.runner.cache.release()
        with pytest.raises(RuntimeError, match="profile failed"), \
                CachePools.profile(backends, num_blocks=3, num_slots=2) as pools:
            held = sum(pool.nbytes for pool in pools.pools.values())
            assert held == sum(pools.bytes_by_backend().values())
            assert held < sum(llm.runner.cache.bytes_by_backend().values())
            raise RuntimeError("profile failed")
        assert not pools.resident and pools.pools == {}
        llm.runner.cache.allocate()  # the agreed size again, for the close
