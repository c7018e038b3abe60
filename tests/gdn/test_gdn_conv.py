"""The causal conv kernels (decode update and varlen prefill) against the naive oracle.

Both the Triton kernel (interpreted on CPU) and the torch path must: match the
token-by-token conv, take history only through the read index, write the final
window only through the write index, leave every other slot byte-identical, and
output zeros for PAD rows.
"""

from __future__ import annotations

import pytest
import torch
from gdn_testkit import (
    DEVICE,
    TOL,
    Case,
    assert_untouched,
    cases,
    poison_fresh_slots,
    rel_rms,
    same_bytes,
    seq_rows,
)
from hypothesis import given
from hypothesis import strategies as st

from kvrunner_gdn.ops.short_conv.inputs import ShortConvInputs
from kvrunner_gdn.ops.short_conv.naive import naive_short_conv
from kvrunner_gdn.ops.short_conv.prefill import short_conv_prefill, short_conv_prefill_split
from kvrunner_gdn.ops.short_conv.prefill_torch import short_conv_prefill_torch
from kvrunner_gdn.ops.short_conv.update import short_conv_update
from kvrunner_gdn.ops.short_conv.update_torch import short_conv_update_torch

UPDATES = [pytest.param(short_conv_update, id="triton"),
           pytest.param(short_conv_update_torch, id="torch")]
PREFILLS = [pytest.param(short_conv_prefill, id="triton"),
            pytest.param(short_conv_prefill_torch, id="torch")]


def conv_inputs(x, pool, weight, bias, read, write, cu_seqlens=None, max_seqlen=None,
                **hints) -> ShortConvInputs:
    """One step's record, every tensor on the test device."""
    dev = lambda t: None if t is None else t.to(DEVICE)
    return ShortConvInputs(x=dev(x), conv_state=pool, weight=dev(weight), bias=dev(bias),
                           read_indices=read, write_indices=write, cu_seqlens=cu_seqlens,
                           max_seqlen=max_seqlen, **hints)


def _setup(case: Case, dim: int, width: int, with_bias: bool):
    gen = torch.Generator().manual_seed(case.seed)
    pool = torch.randn(case.num_slots, dim, width - 1, generator=gen)
    poison_fresh_slots(pool, case)
    x = torch.randn(sum(case.lens), dim, generator=gen)
    weight = torch.randn(dim, width, generator=gen)
    bias = torch.randn(dim, generator=gen) if with_bias else None
    return pool, x, weight, bias


def _check_against_oracle(case, pool_before, pool_after, x, out, weight, bias):
    for i in range(case.num_seqs):
        rows = seq_rows(case, i)
        if case.write[i] < 0:
            assert torch.count_nonzero(out[rows]) == 0, f"PAD row {i} produced output"
            continue
        history = pool_before[case.read[i]] if case.read[i] >= 0 else None
        ref_out, ref_state = naive_short_conv(x[rows], weight, bias, history)
        assert rel_rms(out[rows], ref_out) < TOL, f"sequence {i} output"
        assert rel_rms(pool_after[case.write[i]], ref_state) < TOL, f"sequence {i} conv state"
    assert_untouched(pool_before, pool_after, case)


@pytest.mark.parametrize("update", UPDATES)
@given(
    case=cases(max_len=1),
    dim=st.sampled_from((12, 40)),
    width=st.sampled_from((3, 4)),
    with_bias=st.booleans(),
)
def test_conv_update_matches_oracle_and_writes_only_its_slots(update, case, dim, width,
                                                              with_bias):
    pool, x, weight, bias = _setup(case, dim, width, with_bias)
    pool_dev = pool.to(DEVICE, copy=True)
    read, write = case.indices()
    out = update(inputs=conv_inputs(x, pool_dev, weight, bias, read, write))
    _check_against_oracle(case, pool, pool_dev.cpu(), x, out.cpu(), weight, bias)


@pytest.mark.parametrize("prefill", PREFILLS)
@given(
    case=cases(max_len=9),
    dim=st.sampled_from((12, 40)),
    width=st.sampled_from((3, 4)),
    with_bias=st.booleans(),
)
def test_conv_prefill_matches_oracle_and_writes_only_its_slots(prefill, case, dim, width,
                                                               with_bias):
    pool, x, weight, bias = _setup(case, dim, width, with_bias)
    pool_dev = pool.to(DEVICE, copy=True)
    read, write = case.indices()
    out = prefill(inputs=conv_inputs(x, pool_dev, weight, bias, read, write, case.cu_seqlens,
                                     max(case.lens)))
    _check_against_oracle(case, pool, pool_dev.cpu(), x, out.cpu(), weight, bias)


@pytest.mark.parametrize(("prefill", "update"), [
    pytest.param(short_conv_prefill, short_conv_update, id="triton"),
    pytest.param(short_conv_prefill_torch, short_conv_update_torch, id="torch"),
])
def test_conv_prefill_then_updates_equal_one_long_conv(prefill, update):
    """A 2-token prefill (shorter than the window) then 5 decode updates through the same
    slot give exactly the conv of the 7-token sequence: the history carries across steps."""
    gen = torch.Generator().manual_seed(0)
    dim, width, slot = 20, 4, 3
    x = torch.randn(7, dim, generator=gen)
    weight, bias = torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen)
    pool = torch.full((5, dim, width - 1), float("nan"), device=DEVICE)
    idx = lambda v: torch.tensor([v], dtype=torch.int32, device=DEVICE)
    outs = [prefill(inputs=conv_inputs(x[:2], pool, weight, bias, idx(-1), idx(slot),
                                       idx(0).new_tensor([0, 2]), 2))]
    for t in range(2, 7):
        outs.append(update(inputs=conv_inputs(x[t : t + 1], pool, weight, bias, idx(slot),
                                              idx(slot))))
    ref_out, ref_state = naive_short_conv(x, weight, bias, None)
    assert rel_rms(torch.cat(outs).cpu(), ref_out) < TOL
    assert rel_rms(pool[slot].cpu(), ref_state) < TOL


@given(
    case=cases(max_len=9),
    widths=st.lists(st.integers(1, 20), min_size=1, max_size=3),
    width=st.sampled_from((3, 4)),
    with_bias=st.booleans(),
)
def test_the_sectioned_conv_prefill_is_the_whole_outputs_column_slices_bit_for_bit(
    case, widths, width, with_bias
):
    """Cut into sections (q, k and v in the layer), each a contiguous tensor: the same
    bytes as the whole output's column slices, and the same pool afterwards."""
    dim = sum(widths)
    pool, x, weight, bias = _setup(case, dim, width, with_bias)
    read, write = case.indices()
    whole_pool, cut_pool = pool.to(DEVICE, copy=True), pool.to(DEVICE, copy=True)
    args = (weight, bias, read, write, case.cu_seqlens, max(case.lens))
    whole = short_conv_prefill(inputs=conv_inputs(x, whole_pool, *args))
    cut = short_conv_prefill_split(inputs=conv_inputs(x, cut_pool, *args), sections=widths)
    assert [tuple(part.shape) for part in cut] == [(x.shape[0], w) for w in widths]
    for i, (part, columns) in enumerate(zip(cut, whole.split(widths, 1), strict=True)):
        assert part.is_contiguous() and same_bytes(part, columns), f"section {i}"
    assert same_bytes(cut_pool, whole_pool)


@given(
    case=cases(max_len=9),
    block_t=st.sampled_from((1, 2, 4, 16)),
    block_d=st.sampled_from((16, 32, 64)),
    warps=st.sampled_from((1, 4)),
    channels_fastest=st.booleans(),
    width=st.sampled_from((3, 4)),
    with_bias=st.booleans(),
)
def test_every_tile_of_the_triton_conv_prefill_matches_the_oracle(
    case, block_t, block_d, warps, channels_fastest, width, with_bias
):
    """The output launch's tile (tokens x channels, warps, program order) is a speed
    choice only: tiles shorter than the window put its history in several tiles, and
    tiles narrower than the channels cut them across programs."""
    pool, x, weight, bias = _setup(case, 40, width, with_bias)
    pool_dev = pool.to(DEVICE, copy=True)
    read, write = case.indices()
    out = short_conv_prefill(inputs=conv_inputs(x, pool_dev, weight, bias, read, write,
                                                case.cu_seqlens, max(case.lens)),
                             tiles=(block_t, block_d, warps, channels_fastest))
    _check_against_oracle(case, pool, pool_dev.cpu(), x, out.cpu(), weight, bias)


@given(case=cases(max_len=9), widths=st.lists(st.integers(1, 20), min_size=1, max_size=3))
def test_told_that_the_sequences_cover_every_row_the_conv_skips_zeroing_and_writes_them_all(
    case, widths
):
    """``total_tokens == T`` lets the launcher hand out uninitialised outputs: every row
    must still be written (memory freed full of NaN is what the allocator hands back)."""
    dim = sum(widths)
    pool, x, weight, _ = _setup(case, dim, 4, False)
    read, write = case.indices()
    args = (weight, None, read, write, case.cu_seqlens, max(case.lens))
    want = short_conv_prefill_split(inputs=conv_inputs(x, pool.to(DEVICE, copy=True), *args),
                                    sections=widths)
    pools = pool.to(DEVICE, copy=True)
    # Freed NaN blocks of every section's size, for the allocator to hand back.
    garbage = [torch.full((x.shape[0], w), float("nan"), device=DEVICE) for w in widths]
    del garbage
    got = short_conv_prefill_split(inputs=conv_inputs(x, pools, *args, total_tokens=x.shape[0]),
                                   sections=widths)
    for i, (part, expected) in enumerate(zip(got, want, strict=True)):
        assert same_bytes(part, expected), f"section {i}"


def test_sections_that_do_not_cover_the_channels_are_refused():
    case = Case(lens=(3,), read=(-1,), write=(0,), num_slots=2, seed=1)
    pool, x, weight, _ = _setup(case, 8, 4, False)
    read, write = case.indices()
    for bad in ((3, 4), (4, 5), (8, 0)):
        with pytest.raises(ValueError, match="sum to 8"):
            short_conv_prefill_split(inputs=conv_inputs(x, pool.to(DEVICE), weight, None, read,
                                                        write, case.cu_seqlens, 3), sections=bad)
