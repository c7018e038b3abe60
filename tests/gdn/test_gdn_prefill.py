"""The chunked (WY / UT transform) prefill recurrence over concatenated sequences.

It must equal the token loop for any length (not just multiples of the chunk),
start from the pool only through the read index, store the final state only
through the write index, and continue seamlessly into later prefill chunks and
decode steps.
"""

from __future__ import annotations

import pytest
import torch
from gdn_testkit import (
    DEVICE,
    TOL,
    Heads,
    assert_untouched,
    cases,
    delta_inputs,
    heads,
    poison_fresh_slots,
    qkvgb,
    rel_rms,
    seq_rows,
)
from hypothesis import given

from kvrunner_gdn.ops.gated_delta_rule.chunk import chunk_gated_delta_rule
from kvrunner_gdn.ops.gated_delta_rule.chunk_torch import chunk_gated_delta_rule_torch
from kvrunner_gdn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule
from kvrunner_gdn.ops.gated_delta_rule.fused_recurrent_torch import (
    fused_recurrent_gated_delta_rule_torch,
)
from kvrunner_gdn.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

PREFILLS = [pytest.param(chunk_gated_delta_rule, id="triton"),
            pytest.param(chunk_gated_delta_rule_torch, id="torch")]
CHUNK = 16  # small, so short test sequences still span several chunks


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                        device=DEVICE)


def _idx(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("prefill", PREFILLS)
@given(case=cases(max_len=2 * CHUNK + 3), h=heads)
def test_prefill_matches_token_loop_and_writes_only_its_slots(prefill, case, h):
    gen = torch.Generator().manual_seed(case.seed)
    pool = torch.randn(case.num_slots, h.hv, h.dk, h.dv, generator=gen)
    poison_fresh_slots(pool, case)
    q, k, v, g, beta = qkvgb(h, sum(case.lens), gen)
    pool_dev = pool.to(DEVICE, copy=True)
    read, write = case.indices()
    out = prefill(inputs=delta_inputs(q, k, v, g, beta, pool_dev, read, write, h.dk**-0.5,
                                      cu_seqlens=case.cu_seqlens, chunk_size=CHUNK))
    out, after = out.cpu(), pool_dev.cpu()

    for i in range(case.num_seqs):
        rows = seq_rows(case, i)
        if case.write[i] < 0:
            assert torch.count_nonzero(out[rows]) == 0, f"PAD sequence {i} produced output"
            continue
        initial = pool[case.read[i]] if case.read[i] >= 0 else None
        ref_out, ref_state = naive_recurrent_gated_delta_rule(
            *(t[rows].cpu() for t in (q, k, v, g, beta)), initial
        )
        assert rel_rms(out[rows], ref_out) < TOL, f"sequence {i} (len {case.lens[i]}) output"
        assert rel_rms(after[case.write[i]], ref_state) < TOL, f"sequence {i} state"
    assert_untouched(pool, after, case)


@pytest.mark.parametrize("chunk", [CHUNK, 64])
@pytest.mark.parametrize("prefill", PREFILLS)
def test_prefill_lengths_off_the_chunk_grid_and_strong_decay(prefill, chunk):
    """Lengths 1, chunk-1, chunk+1, 2*chunk+3, one value head per decay regime, from
    exp(-30) per token (the chunk math must stay finite: all exponents <= 0) to almost
    none (so tokens a whole chunk apart still interact: a 64-token chunk is four
    16-row tiles in the Triton solve, and every off-diagonal tile must be right)."""
    lens = [1, chunk - 1, chunk + 1, 2 * chunk + 3]
    h = Heads(2, 4, 16, 8)
    gen = torch.Generator().manual_seed(7)
    q, k, v, _, beta = qkvgb(h, sum(lens), gen)
    per_head = torch.tensor([30.0, 1.0, 0.05, 0.002])
    g = (-per_head * torch.rand(sum(lens), h.hv, generator=gen) ** 3).to(DEVICE)
    pool = torch.randn(4, h.hv, h.dk, h.dv, generator=gen).to(DEVICE)
    before = pool.clone()
    out = prefill(inputs=delta_inputs(q, k, v, g, beta, pool, _idx(0, 1, -1, 3),
                                      _idx(0, 1, 2, 3), h.dk**-0.5, cu_seqlens=_cu(lens),
                                      chunk_size=chunk))
    start = 0
    for i, n in enumerate(lens):
        rows = slice(start, start + n)
        initial = before[i].cpu() if i != 2 else None
        ref_out, ref_state = naive_recurrent_gated_delta_rule(
            *(t[rows].cpu() for t in (q, k, v, g, beta)), initial
        )
        assert torch.isfinite(out[rows]).all()
        assert rel_rms(out[rows].cpu(), ref_out) < TOL, f"length {n}"
        assert rel_rms(pool[i].cpu(), ref_state) < TOL, f"length {n} state"
        start += n


@pytest.mark.parametrize(("prefill", "decode"), [
    pytest.param(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, id="triton"),
    pytest.param(chunk_gated_delta_rule_torch, fused_recurrent_gated_delta_rule_torch,
                 id="torch"),
])
def test_prefill_in_two_steps_then_decode_equals_one_long_recurrence(prefill, decode):
    """20 prompt tokens, then 9 more as a second (chunked-prefill) step, then 6 decode
    steps, all through slot 2 (NaN before the first step): the outputs and the final
    state are those of one 35-token recurrence from zero."""
    h = Heads(1, 2, 16, 16)
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta = qkvgb(h, 35, gen)
    pool = torch.full((3, h.hv, h.dk, h.dv), float("nan"), device=DEVICE)
    scale = h.dk**-0.5
    outs = []
    for lo, hi, read in ((0, 20, -1), (20, 29, 2)):
        part = [t[lo:hi] for t in (q, k, v, g, beta)]
        outs.append(prefill(inputs=delta_inputs(*part, pool, _idx(read), _idx(2), scale,
                                                cu_seqlens=_cu([hi - lo]), chunk_size=CHUNK)))
    for t in range(29, 35):
        part = [x[t : t + 1] for x in (q, k, v, g, beta)]
        outs.append(decode(inputs=delta_inputs(*part, pool, _idx(2), _idx(2), scale)))
    ref_out, ref_state = naive_recurrent_gated_delta_rule(
        *(t.cpu() for t in (q, k, v, g, beta)), None)
    assert rel_rms(torch.cat(outs).cpu(), ref_out) < TOL
    assert rel_rms(pool[2].cpu(), ref_state) < TOL
    assert torch.isnan(pool[:2]).all(), "slots 0 and 1 were never indexed"
