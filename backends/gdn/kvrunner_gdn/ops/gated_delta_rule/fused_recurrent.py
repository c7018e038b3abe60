"""The gated delta rule for decode, in Triton: one token per sequence, state read and
written in the pool.

For row ``b`` and value head ``h`` (key head ``h // (Hv // Hk)``), with ``S`` the
``[K, V]`` state at ``state[read[b], h]`` (zeros when ``read[b] < 0``)::

    S = S * exp(g[b, h])
    S = S + k (beta[b, h] * (v - S^T k))^T
    o = S^T q                                  # q, k L2-normalised, q scaled

and ``S`` is stored at ``state[write[b], h]``. Rows with ``write[b] < 0`` (PAD) read
nothing, write nothing and output zeros. The Triton kernel runs one program per
(row, value head, block of V columns) and loads/stores the pool directly through
the indices: no gathered copy of the state is ever made.
"""

import torch
import triton
import triton.language as tl

from kvrunner_gdn.ops.gated_delta_rule.inputs import GatedDeltaRuleInputs
from kvrunner_gdn.ops.gated_delta_rule.naive import L2NORM_EPS
from kvrunner_gdn.ops.slots_triton import row_slots
from kvrunner_gdn.ops.utils import next_pow2


@triton.jit
def _gdn_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, read_ptr, write_ptr,
    scale, head_k, head_v, group,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_g_t, stride_b_t, stride_o_t, stride_o_h,
    stride_s_n, stride_s_h, stride_s_k,
    L2NORM: tl.constexpr, EPS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // group
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    vmask = vv < head_v
    w_idx, r_idx, runs, k_run_bound, k_read_bound = row_slots(read_ptr, write_ptr, row, head_k)
    k_run = kk < k_run_bound  # empty for a PAD row
    k_read = kk < k_read_bound  # also without a prior state

    q = tl.load(q_ptr + row * stride_q_t + hk * stride_q_h + kk, mask=k_run, other=0.0)
    k = tl.load(k_ptr + row * stride_k_t + hk * stride_k_h + kk, mask=k_run, other=0.0)
    v = tl.load(v_ptr + row * stride_v_t + hv * stride_v_h + vv, mask=vmask, other=0.0)
    q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
    if L2NORM:
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + EPS)
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + EPS)
    q = q * scale
    decay = tl.exp(tl.load(g_ptr + row * stride_g_t + hv).to(tl.float32))
    beta = tl.load(beta_ptr + row * stride_b_t + hv).to(tl.float32)

    offs = kk[:, None] * stride_s_k + vv[None, :]
    r_base = state_ptr + tl.maximum(r_idx, 0) * stride_s_n + hv * stride_s_h
    s = tl.load(r_base + offs, mask=k_read[:, None] & vmask[None, :], other=0.0) * decay
    delta = beta * (v - tl.sum(s * k[:, None], axis=0))
    s = s + k[:, None] * delta[None, :]
    o = tl.where(runs, tl.sum(s * q[:, None], axis=0), 0.0)
    tl.store(out_ptr + row * stride_o_t + hv * stride_o_h + vv, o.to(out_ptr.dtype.element_ty),
             mask=vmask)
    w_base = state_ptr + tl.maximum(w_idx, 0) * stride_s_n + hv * stride_s_h
    tl.store(w_base + offs, s, mask=k_run[:, None] & vmask[None, :])


def fused_recurrent_gated_delta_rule(*, inputs: GatedDeltaRuleInputs) -> torch.Tensor:
    """One token per sequence: ``[B, Hv, V]`` in v's dtype; the pool updated in place.
    Graph-capturable (no host syncs)."""
    x = inputs
    rows = x.sequences(chunked=False)
    num_k_heads, head_k = x.k.shape[1:]
    num_v_heads, head_v = x.v.shape[1:]
    q, k, v, state = x.q, x.k, x.v, x.state
    g, beta = x.g.contiguous(), x.beta.contiguous()
    out = torch.empty(rows, num_v_heads, head_v, dtype=v.dtype, device=v.device)
    if rows == 0:
        return out
    block_v = min(32, next_pow2(head_v))
    grid = (rows, num_v_heads, triton.cdiv(head_v, block_v))
    _gdn_decode_kernel[grid](
        q, k, v, g, beta, out, state, x.read_indices, x.write_indices,
        float(x.scale), head_k, head_v, num_v_heads // num_k_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), out.stride(0), out.stride(1),
        state.stride(0), state.stride(1), state.stride(2),
        L2NORM=x.use_qk_l2norm, EPS=L2NORM_EPS, BLOCK_K=next_pow2(head_k), BLOCK_V=block_v,
    )  # fmt: skip
    return out
