"""The decode recurrence (one token per sequence, state in place in the pool).

Triton (interpreted on CPU) and torch paths against the fp32 token-by-token oracle,
over random batches, head shapes (including value heads a multiple of key heads)
and state-index maps with fresh, continuing, forked and PAD rows.
"""

from __future__ import annotations

import pytest
import torch
from gdn_testkit import (
    DEVICE,
    TOL,
    assert_untouched,
    cases,
    delta_inputs,
    heads,
    poison_fresh_slots,
    qkvgb,
    rel_rms,
)
from hypothesis import given

from kvrunner_gdn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule
from kvrunner_gdn.ops.gated_delta_rule.fused_recurrent_torch import (
    fused_recurrent_gated_delta_rule_torch,
)
from kvrunner_gdn.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

DECODES = [pytest.param(fused_recurrent_gated_delta_rule, id="triton"),
           pytest.param(fused_recurrent_gated_delta_rule_torch, id="torch")]


@pytest.mark.parametrize("decode", DECODES)
@given(case=cases(max_len=1), h=heads)
def test_decode_matches_oracle_and_writes_only_its_slots(decode, case, h):
    gen = torch.Generator().manual_seed(case.seed)
    pool = torch.randn(case.num_slots, h.hv, h.dk, h.dv, generator=gen)
    poison_fresh_slots(pool, case)
    q, k, v, g, beta = qkvgb(h, case.num_seqs, gen)
    pool_dev = pool.to(DEVICE, copy=True)
    read, write = case.indices()
    out = decode(inputs=delta_inputs(q, k, v, g, beta, pool_dev, read, write, h.dk**-0.5))
    out, after = out.cpu(), pool_dev.cpu()

    for i in range(case.num_seqs):
        if case.write[i] < 0:
            assert torch.count_nonzero(out[i]) == 0, f"PAD row {i} produced output"
            continue
        initial = pool[case.read[i]] if case.read[i] >= 0 else None
        ref_out, ref_state = naive_recurrent_gated_delta_rule(
            *(t[i : i + 1].cpu() for t in (q, k, v, g, beta)), initial
        )
        assert rel_rms(out[i], ref_out[0]) < TOL, f"row {i} output"
        assert rel_rms(after[case.write[i]], ref_state) < TOL, f"row {i} state"
    assert_untouched(pool, after, case)


@pytest.mark.parametrize("decode", DECODES)
def test_decode_bf16_inputs_stay_close_to_fp32_oracle(decode):
    """Model-dtype (bf16) q/k/v: fp32 state math, bf16 output within bf16 rounding."""
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(3, 4, 16, 16, generator=gen)
    q, k, v = (torch.randn(2, h, 16, generator=gen) for h in (2, 2, 4))
    g, beta = -torch.rand(2, 4, generator=gen), torch.rand(2, 4, generator=gen)
    idx = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    pool_dev = pool.to(DEVICE, copy=True)
    bf = lambda t: t.to(DEVICE, torch.bfloat16)
    out = decode(inputs=delta_inputs(bf(q), bf(k), bf(v), g.to(DEVICE), beta.to(DEVICE),
                                     pool_dev, idx, idx, 16**-0.5))
    assert out.dtype == torch.bfloat16
    up = lambda t: t.to(torch.bfloat16).float()
    for i, slot in enumerate((2, 0)):
        ref_out, ref_state = naive_recurrent_gated_delta_rule(
            up(q[i : i + 1]), up(k[i : i + 1]), up(v[i : i + 1]), g[i : i + 1], beta[i : i + 1],
            pool[slot],
        )
        assert rel_rms(out[i].float(), ref_out[0]) < 1e-2
        assert rel_rms(pool_dev[slot], ref_state) < TOL
