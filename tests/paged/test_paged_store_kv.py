"""store_kv writes each real token's key and value to its slot, and not one byte more."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from paged_cases import TRITON_DEVICE, PagedCase, paged_cases

from kvrunner.plugin_api import PAD_SLOT_ID
from kvrunner_paged.ops.store_kv.naive import naive_store_kv
from kvrunner_paged.ops.store_kv.store import store_kv
from kvrunner_paged.ops.store_kv.store_torch import store_kv_torch


def _store_kv_triton(
    *, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The Triton kernel on its device, results copied back into the given caches."""
    on = TRITON_DEVICE
    k_dev, v_dev = k_cache.to(on), v_cache.to(on)
    store_kv(k=k.to(on), v=v.to(on), k_cache=k_dev, v_cache=v_dev,
             slot_mapping=slot_mapping.to(on))
    k_cache.copy_(k_dev)
    v_cache.copy_(v_dev)


IMPLS = {"triton": _store_kv_triton, "torch": store_kv_torch}


def _new_kv(case: PagedCase, rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v as strided views into one projection output, like a model hands them over."""
    kv = torch.randn((rows, 2 * case.num_kv_heads + 1, case.head_dim), generator=gen)
    return kv[:, : case.num_kv_heads], kv[:, case.num_kv_heads : 2 * case.num_kv_heads]


def _with_pads_inside(slots: torch.Tensor, pad_mask: list[bool]) -> torch.Tensor:
    """PAD rows anywhere, not only in the tail: the kernel may assume nothing about order."""
    out = slots.clone()
    for i, is_pad in enumerate(pad_mask[: len(out)]):
        if is_pad:
            out[i] = PAD_SLOT_ID
    return out


@pytest.mark.parametrize("impl", IMPLS)
@given(case=paged_cases(), pad_mask=st.lists(st.booleans(), max_size=40))
def test_store_kv_writes_exactly_the_real_slots(
    impl: str, case: PagedCase, pad_mask: list[bool]
) -> None:
    gen = case.generator()
    before = case.pool(gen, poison_unread=False)
    slots = _with_pads_inside(case.slot_mapping(), pad_mask)
    k, v = _new_kv(case, len(slots), gen)
    after = before.clone()
    IMPLS[impl](k=k, v=v, k_cache=after[0], v_cache=after[1], slot_mapping=slots)

    flat_before = before.view(2, -1, case.num_kv_heads, case.head_dim)
    flat_after = after.view(2, -1, case.num_kv_heads, case.head_dim)
    real = slots >= 0
    written = slots[real]
    assert torch.equal(flat_after[0, written], k[real])
    assert torch.equal(flat_after[1, written], v[real])
    untouched = torch.ones(flat_before.shape[1], dtype=torch.bool)
    untouched[written] = False
    # Bit-for-bit: compare as integers so even NaN payloads would have to match.
    assert torch.equal(
        flat_after[:, untouched].view(torch.int32), flat_before[:, untouched].view(torch.int32)
    )

    expected = before.clone()
    naive_store_kv(k, v, expected[0], expected[1], slots)
    assert torch.equal(after, expected)


@pytest.mark.parametrize("impl", IMPLS)
@given(case=paged_cases())
def test_store_kv_over_an_all_pad_slot_mapping_writes_nothing(impl: str, case: PagedCase) -> None:
    """What a capture does: the core blanked slot_mapping, the forward still runs."""
    gen = case.generator()
    before = case.pool(gen, poison_unread=True)  # NaN too: bytes, not values, must match
    slots = torch.full((case.num_tokens + case.num_pad_rows,), PAD_SLOT_ID, dtype=torch.int64)
    k, v = _new_kv(case, len(slots), gen)
    after = before.clone()
    IMPLS[impl](k=k, v=v, k_cache=after[0], v_cache=after[1], slot_mapping=slots)
    assert torch.equal(after.view(torch.int32), before.view(torch.int32))


@pytest.mark.parametrize("impl", IMPLS)
def test_store_kv_reads_only_the_first_num_tokens_slots(impl: str) -> None:
    """slot_mapping may be the whole persistent buffer; rows past k's length are not tokens."""
    k_cache = torch.zeros((4, 4, 1, 16))
    v_cache = torch.zeros((4, 4, 1, 16))
    k = torch.ones((2, 1, 16))
    v = torch.full((2, 1, 16), 2.0)
    slots = torch.tensor([5, 9, 13, 14], dtype=torch.int64)  # 13, 14: a longer buffer's rows
    IMPLS[impl](k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    flat_k = k_cache.view(-1, 1, 16)
    flat_v = v_cache.view(-1, 1, 16)
    assert flat_k[[5, 9]].eq(1).all() and flat_v[[5, 9]].eq(2).all()
    assert flat_k.sum() == 2 * 16 and flat_v.sum() == 2 * 2 * 16
