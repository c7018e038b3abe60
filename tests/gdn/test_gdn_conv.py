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
    seq_rows,
)
from hypothesis import given
from hypothesis import strategies as st

from kvrunner_gdn.kernels.conv_prefill import conv1d_prefill
from kvrunner_gdn.kernels.conv_update import conv1d_update
from kvrunner_gdn.kernels.reference import ref_causal_conv1d

PATHS = [pytest.param(True, id="triton"), pytest.param(False, id="torch")]


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
        ref_out, ref_state = ref_causal_conv1d(x[rows], weight, bias, history)
        assert rel_rms(out[rows], ref_out) < TOL, f"sequence {i} output"
        assert rel_rms(pool_after[case.write[i]], ref_state) < TOL, f"sequence {i} conv state"
    assert_untouched(pool_before, pool_after, case)


@pytest.mark.parametrize("use_triton", PATHS)
@given(
    case=cases(max_len=1),
    dim=st.sampled_from((12, 40)),
    width=st.sampled_from((3, 4)),
    with_bias=st.booleans(),
)
def test_conv_update_matches_oracle_and_writes_only_its_slots(use_triton, case, dim, width,
                                                              with_bias):
    pool, x, weight, bias = _setup(case, dim, width, with_bias)
    pool_dev = pool.to(DEVICE, copy=True)
    read, write = case.indices()
    dev = lambda t: None if t is None else t.to(DEVICE)
    out = conv1d_update(x.to(DEVICE), pool_dev, weight.to(DEVICE), dev(bias), read, write,
                        use_triton=use_triton)
    _check_against_oracle(case, pool, pool_dev.cpu(), x, out.cpu(), weight, bias)


@pytest.mark.parametrize("use_triton", PATHS)
@given(
    case=cases(max_len=9),
    dim=st.sampled_from((12, 40)),
    width=st.sampled_from((3, 4)),
    with_bias=st.booleans(),
)
def test_conv_prefill_matches_oracle_and_writes_only_its_slots(use_triton, case, dim, width,
                                                               with_bias):
    pool, x, weight, bias = _setup(case, dim, width, with_bias)
    pool_dev = pool.to(DEVICE, copy=True)
    read, write = case.indices()
    dev = lambda t: None if t is None else t.to(DEVICE)
    out = conv1d_prefill(x.to(DEVICE), pool_dev, weight.to(DEVICE), dev(bias), case.cu_seqlens,
                         read, write, max(case.lens), use_triton=use_triton)
    _check_against_oracle(case, pool, pool_dev.cpu(), x, out.cpu(), weight, bias)


@pytest.mark.parametrize("use_triton", PATHS)
def test_conv_prefill_then_updates_equal_one_long_conv(use_triton):
    """A 2-token prefill (shorter than the window) then 5 decode updates through the same
    slot give exactly the conv of the 7-token sequence: the history carries across steps."""
    gen = torch.Generator().manual_seed(0)
    dim, width, slot = 20, 4, 3
    x = torch.randn(7, dim, generator=gen)
    weight, bias = torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen)
    pool = torch.full((5, dim, width - 1), float("nan"), device=DEVICE)
    idx = lambda v: torch.tensor([v], dtype=torch.int32, device=DEVICE)
    d = lambda t: t.to(DEVICE)
    outs = [conv1d_prefill(d(x[:2]), pool, d(weight), d(bias), idx(0).new_tensor([0, 2]),
                           idx(-1), idx(slot), 2, use_triton=use_triton)]
    for t in range(2, 7):
        outs.append(conv1d_update(d(x[t : t + 1]), pool, d(weight), d(bias), idx(slot), idx(slot),
                                  use_triton=use_triton))
    ref_out, ref_state = ref_causal_conv1d(x, weight, bias, None)
    assert rel_rms(torch.cat(outs).cpu(), ref_out) < TOL
    assert rel_rms(pool[slot].cpu(), ref_state) < TOL
