"""Decode attention over the paged pool agrees with the naive reference, padded rows included."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from paged_cases import TRITON_DEVICE, PagedCase, assert_matches_reference, paged_cases

from kvrunner.plugin_api import PAD_SLOT_ID
from kvrunner_paged.ops.paged_attention.decode import (
    MAX_SPLITS,
    SPLIT_MIN_KEYS,
    SPLIT_WAVES,
    choose_num_splits,
    paged_decode_attention,
)
from kvrunner_paged.ops.paged_attention.decode_torch import paged_decode_attention_torch
from kvrunner_paged.ops.paged_attention.inputs import NewKV, PagedAttentionInputs
from kvrunner_paged.ops.paged_attention.naive import naive_paged_attention
from kvrunner_paged.ops.store_kv.naive import naive_store_kv


def _decode_inputs(case: PagedCase) -> dict[str, torch.Tensor]:
    """Rows = real sequences + padded tail (context length 0); unread slots hold NaN."""
    gen = case.generator()
    rows = case.num_seqs + case.num_pad_rows
    pool = case.pool(gen, poison_unread=True)
    return {
        "q": torch.randn((rows, case.num_heads, case.head_dim), generator=gen),
        "k_cache": pool[0],
        "v_cache": pool[1],
        "block_tables": case.block_table_tensor(rows),
        "context_lens": case.context_lens_tensor(rows),
    }


def _reference(case: PagedCase, x: dict[str, torch.Tensor]) -> torch.Tensor:
    rows = x["q"].shape[0]
    one_query_each = torch.arange(rows + 1, dtype=torch.int32)
    return naive_paged_attention(
        x["q"], x["k_cache"], x["v_cache"], x["block_tables"], one_query_each,
        x["context_lens"], case.scale,
    )


@given(case=paged_cases(decode=True), num_splits=st.sampled_from([1, 2, 3]))
def test_triton_decode_matches_reference(case: PagedCase, num_splits: int) -> None:
    x = _decode_inputs(case)
    on_device = {k: t.to(TRITON_DEVICE) for k, t in x.items()}
    out = paged_decode_attention(inputs=PagedAttentionInputs(**on_device, scale=case.scale),
                                 num_splits=num_splits, block_n=16)
    assert_matches_reference(out.cpu(), _reference(case, x))


def _fused_inputs(case: PagedCase) -> dict[str, torch.Tensor]:
    """Decode inputs plus this step's keys and values, not yet in the pool: the pool holds
    NaN at each row's newest slot, so a kernel that read it back would output NaN."""
    x = _decode_inputs(case)
    gen = case.generator()
    rows = x["q"].shape[0]
    # strided views into one projection output, as a model hands them over
    kv = torch.randn((rows, 2 * case.num_kv_heads + 1, case.head_dim), generator=gen)
    x["k_new"] = kv[:, : case.num_kv_heads]
    x["v_new"] = kv[:, case.num_kv_heads : 2 * case.num_kv_heads]
    x["slots"] = case.slot_mapping()
    for slot in x["slots"][: case.num_seqs].tolist():
        block, offset = divmod(slot, case.block_size)
        x["k_cache"][block, offset] = float("nan")
        x["v_cache"][block, offset] = float("nan")
    return x


def _fused_decode(case: PagedCase, x: dict[str, torch.Tensor], num_splits: int) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor
]:
    """The fused launch on the Triton device: (output, k pool after, v pool after)."""
    on = {k: t.to(TRITON_DEVICE) for k, t in x.items()}
    inputs = PagedAttentionInputs(
        q=on["q"], k_cache=on["k_cache"], v_cache=on["v_cache"], block_tables=on["block_tables"],
        context_lens=on["context_lens"], scale=case.scale,
        new_kv=NewKV(k=on["k_new"], v=on["v_new"], slot_mapping=on["slots"]),
    )  # fmt: skip
    out = paged_decode_attention(inputs=inputs, num_splits=num_splits, block_n=16)
    return out.cpu(), on["k_cache"].cpu(), on["v_cache"].cpu()


@given(case=paged_cases(decode=True), num_splits=st.sampled_from([1, 2, 3]))
def test_fused_store_decode_equals_store_then_attend(case: PagedCase, num_splits: int) -> None:
    """With ``new_kv`` the launch stores the step's keys and values and attends them: the
    output is the reference's over the stored pool, and the pool after it equals the
    reference store's, bit for bit (NaN payloads of unread slots included)."""
    x = _fused_inputs(case)
    out, k_after, v_after = _fused_decode(case, x, num_splits)
    expected = {**x, "k_cache": x["k_cache"].clone(), "v_cache": x["v_cache"].clone()}
    naive_store_kv(x["k_new"], x["v_new"], expected["k_cache"], expected["v_cache"], x["slots"])
    assert torch.equal(k_after.view(torch.int32), expected["k_cache"].view(torch.int32))
    assert torch.equal(v_after.view(torch.int32), expected["v_cache"].view(torch.int32))
    assert_matches_reference(out, _reference(case, expected))


@given(case=paged_cases(decode=True), num_splits=st.sampled_from([1, 3]))
def test_fused_store_decode_over_an_all_pad_slot_mapping_writes_nothing(
    case: PagedCase, num_splits: int
) -> None:
    """What a capture does to the fused launch: slot_mapping blanked to PAD, every
    context length left as it was. Not one byte of the pool may change."""
    x = _fused_inputs(case)
    x["slots"] = torch.full_like(x["slots"], PAD_SLOT_ID)
    _, k_after, v_after = _fused_decode(case, x, num_splits)
    assert torch.equal(k_after.view(torch.int32), x["k_cache"].view(torch.int32))
    assert torch.equal(v_after.view(torch.int32), x["v_cache"].view(torch.int32))


@given(case=paged_cases(decode=True))
def test_torch_decode_matches_reference(case: PagedCase) -> None:
    x = _decode_inputs(case)
    out = paged_decode_attention_torch(inputs=PagedAttentionInputs(**x, scale=case.scale))
    assert_matches_reference(out, _reference(case, x))


@pytest.mark.parametrize("num_splits", [5, 9, 33, MAX_SPLITS])
def test_every_split_holds_keys_of_a_long_context_and_the_merge_weighs_them_all(
    num_splits: int,
) -> None:
    """Contexts of hundreds of keys in 16-key tiles, so each of up to 64 splits has keys
    of its own: the merge (whose lane count is padded to 8 or to MAX_SPLITS) must weigh
    every split, whatever the pad."""
    gen = torch.Generator().manual_seed(num_splits)
    block, heads, kv_heads, dim = 16, 4, 2, 16
    lens = [1100, 700, 1]
    tables = torch.randperm(3 * 70, generator=gen).view(3, 70).to(torch.int32)
    k_cache = torch.randn((3 * 70, block, kv_heads, dim), generator=gen)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn((3, heads, dim), generator=gen)
    context = torch.tensor(lens, dtype=torch.int32)
    on = {name: t.to(TRITON_DEVICE) for name, t in
          dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables,
               context_lens=context).items()}
    out = paged_decode_attention(inputs=PagedAttentionInputs(**on, scale=0.25),
                                 num_splits=num_splits, block_n=16)
    ref = naive_paged_attention(q, k_cache, v_cache, tables, torch.arange(4, dtype=torch.int32),
                                context, 0.25)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_triton_decode_padded_rows_are_zero_and_live_rows_are_not(num_splits: int) -> None:
    """The reference says zeros for empty rows; check the kernel says so independently too."""
    on = TRITON_DEVICE
    k_cache = torch.randn((4, 4, 1, 16), device=on)
    v_cache = torch.randn((4, 4, 1, 16), device=on)
    q = torch.randn((3, 2, 16), device=on)
    tables = torch.tensor([[2, 1], [0, 0], [0, 0]], dtype=torch.int32, device=on)
    lens = torch.tensor([6, 0, 0], dtype=torch.int32, device=on)
    inputs = PagedAttentionInputs(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                                  context_lens=lens, scale=0.25)
    out = paged_decode_attention(inputs=inputs, num_splits=num_splits)
    assert out[1:].eq(0).all()
    assert out[0].abs().sum() > 0


@given(
    rows=st.integers(1, 512),
    kv_heads=st.integers(1, 16),
    max_len=st.integers(1, 1 << 17),
    sms=st.integers(1, 264),
)
def test_choose_num_splits_fills_the_machine_without_tiny_splits(
    rows: int, kv_heads: int, max_len: int, sms: int
) -> None:
    programs = rows * kv_heads
    splits = choose_num_splits(rows, kv_heads, max_len, sms)
    assert 1 <= splits <= MAX_SPLITS
    if programs >= sms:
        assert splits == 1  # already one program per SM or more: splitting only adds a merge
    if splits > 1:
        assert max_len // splits >= SPLIT_MIN_KEYS  # each split still has real work
        assert programs * splits <= SPLIT_WAVES * sms  # never a partial extra wave
    else:  # one split only when the machine is already full or the sequence is short
        assert programs >= sms or max_len < 2 * SPLIT_MIN_KEYS
