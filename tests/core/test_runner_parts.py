"""Runner building blocks: forward_vars, sizing, blanking and the pool audit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvrunner.contract import CacheSpec, CacheWriteTarget
from kvrunner.runner.capture_safety import CaptureAuditError, PoolSnapshot, blank_write_targets
from kvrunner.runner.forward_vars import ForwardVars
from kvrunner.runner.graphs import default_capture_sizes
from kvrunner.runner.sizing import CacheSizingError, num_blocks_for_budget


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
    specs = [CacheSpec(backend=f"b{i}", bytes_per_block=b) for i, b in enumerate(per_block)]
    specs += [CacheSpec(backend=f"s{i}", bytes_per_slot=s) for i, s in enumerate(per_slot)]
    block, slot = sum(per_block), sum(per_slot)
    try:
        n = num_blocks_for_budget(specs, budget_bytes=budget, num_slots=slots, min_blocks=1)
    except CacheSizingError as e:
        assert "need at least 1" in str(e)
        assert budget - slot * slots < block  # it really did not fit
        return
    used = n * block + slots * slot
    assert used <= budget < used + block


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
    PoolSnapshot({"p": pool}).require_unchanged(batch_size=1, blanked=[])


@pytest.mark.parametrize("change", ["value", "nan", "negative_zero"])
def test_audit_names_the_pool_a_capture_wrote(change: str) -> None:
    pools = {"kv.0": torch.zeros(3, 4), "kv.1": torch.zeros(3, 4)}
    snap = PoolSnapshot(pools)
    pools["kv.1"][2, 1] = {"value": 1.0, "nan": float("nan"), "negative_zero": -0.0}[change]
    with pytest.raises(CaptureAuditError, match=r"batch size 8.*\['kv.1'\]"):
        snap.require_unchanged(batch_size=8, blanked=[])
