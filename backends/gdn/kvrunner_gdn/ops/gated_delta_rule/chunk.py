"""The gated delta rule for prefill, in Triton: chunk-parallel (WY / UT transform), varlen,
state in the pool.

Within a chunk of ``C`` tokens starting from state ``S0`` (``[K, V]``), let ``G_t`` be
the cumulative log-decay from the chunk start through token ``t``. Unrolling the
token recurrence gives, for the "new values" ``U`` (the part of each ``beta v`` the
state did not already predict)::

    (I + A) U = beta*V - (beta*K * exp(G)) S0,    A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j), i > j

so with ``T = (I + A)^-1`` (A is strictly lower triangular, T by forward
substitution): ``U = u - w S0`` where ``u = T(beta*V)`` and ``w = T(beta*K*exp(G))``.
Then::

    O       = (Q * exp(G)) S0 + (Q K^T * exp(G_i - G_j), i >= j) U
    S_next  = exp(G_last) S0 + (K * exp(G_last - G))^T U

Every exponent is <= 0, so nothing overflows however strong the decay.

The Triton path is two launches. ``_ut_kernel`` (one program per chunk and value
head, all chunks in parallel) does the expensive, state-free part: ``G``, the
triangular solve, ``u`` and ``w``, into fp32 scratch. ``_scan_kernel`` (one program
per sequence, value head and block of V columns) then walks the chunks in order,
carrying its state block in registers: three or four matrix products per chunk.

Sequence ``s`` owns rows ``cu_seqlens[s]:cu_seqlens[s+1]``; it starts from
``state[read[s]]`` (zeros when ``read[s] < 0``) and its final state goes to
``state[write[s]]``. A sequence with ``write[s] < 0`` reads and writes nothing and
outputs zeros.
"""

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kvrunner.plugin_api import on_device
from kvrunner_gdn.ops.gated_delta_rule.inputs import GatedDeltaRuleInputs
from kvrunner_gdn.ops.gated_delta_rule.naive import L2NORM_EPS
from kvrunner_gdn.ops.gated_delta_rule.tril_inverse import unit_lower_inverse
from kvrunner_gdn.ops.slots_triton import row_slots
from kvrunner_gdn.ops.utils import dot_block, next_pow2


@triton.jit
def _l2norm_rows(x, EPS: tl.constexpr):
    return x / tl.sqrt(tl.sum(x * x, axis=1) + EPS)[:, None]


@triton.jit
def _ut_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, u_ptr, w_ptr, gcum_ptr, chunk_row_ptr, chunk_end_ptr,
    a_scratch_ptr, t_scratch_ptr,
    head_k, head_v, group,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_g_t, stride_b_t,
    L2NORM: tl.constexpr, EPS: tl.constexpr,
    CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Outputs u ``[T, Hv, V]``, w ``[T, Hv, K]``, gcum ``[T, Hv]`` (contiguous fp32);
    ``a_scratch``/``t_scratch`` hold one ``[CHUNK, CHUNK]`` tile per program."""
    cid = tl.program_id(0)
    hv = tl.program_id(1)
    num_v_heads = tl.num_programs(1)
    hk = hv // group
    row0 = tl.load(chunk_row_ptr + cid).to(tl.int64)
    end = tl.load(chunk_end_ptr + cid).to(tl.int64)
    tt = tl.arange(0, CHUNK)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.arange(0, BLOCK_V)
    rows = row0 + tt
    tmask = rows < end
    kmask = tmask[:, None] & (kk < head_k)[None, :]
    vmask = tmask[:, None] & (vv < head_v)[None, :]
    # Tokens past the end load as k = v = beta = g = 0: they change neither u nor w.
    kc = tl.load(k_ptr + rows[:, None] * stride_k_t + hk * stride_k_h + kk[None, :],
                 mask=kmask, other=0.0).to(tl.float32)
    vc = tl.load(v_ptr + rows[:, None] * stride_v_t + hv * stride_v_h + vv[None, :],
                 mask=vmask, other=0.0).to(tl.float32)
    gc = tl.load(g_ptr + rows * stride_g_t + hv, mask=tmask, other=0.0).to(tl.float32)
    bc = tl.load(beta_ptr + rows * stride_b_t + hv, mask=tmask, other=0.0).to(tl.float32)
    if L2NORM:
        kc = _l2norm_rows(kc, EPS)
    gcum = tl.cumsum(gc, axis=0)
    strict = tt[:, None] > tt[None, :]
    kb = kc * bc[:, None]
    a = tl.dot(kb, tl.trans(kc), input_precision="ieee")
    a = tl.where(strict, a * tl.exp(tl.where(strict, gcum[:, None] - gcum[None, :], 0.0)), 0.0)
    tile = (cid * num_v_heads + hv) * CHUNK * CHUNK
    tinv = unit_lower_inverse(a, a_scratch_ptr + tile, t_scratch_ptr + tile, CHUNK, SUB)
    u = tl.dot(tinv, vc * bc[:, None], input_precision="ieee")
    w = tl.dot(tinv, kb * tl.exp(gcum)[:, None], input_precision="ieee")
    base = rows * num_v_heads + hv
    tl.store(u_ptr + base[:, None] * head_v + vv[None, :], u, mask=vmask)
    tl.store(w_ptr + base[:, None] * head_k + kk[None, :], w, mask=kmask)
    tl.store(gcum_ptr + base, gcum, mask=tmask)


@triton.jit
def _scan_kernel(
    q_ptr, k_ptr, u_ptr, w_ptr, gcum_ptr, out_ptr, state_ptr, cu_ptr, read_ptr, write_ptr,
    scale, head_k, head_v, group,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_o_t, stride_o_h,
    stride_s_n, stride_s_h, stride_s_k,
    L2NORM: tl.constexpr, EPS: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    hv = tl.program_id(1)
    num_v_heads = tl.num_programs(1)
    hk = hv // group
    start = tl.load(cu_ptr + seq).to(tl.int64)
    length = tl.load(cu_ptr + seq + 1).to(tl.int64) - start
    w_idx, r_idx, runs, k_run_bound, k_read_bound = row_slots(read_ptr, write_ptr, seq, head_k)

    tt = tl.arange(0, CHUNK)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask = kk < head_k
    vmask = vv < head_v
    causal = tt[:, None] >= tt[None, :]
    k_run = kk < k_run_bound  # empty for a PAD sequence
    k_read = kk < k_read_bound  # also without history
    offs = kk[:, None] * stride_s_k + vv[None, :]
    r_base = state_ptr + tl.maximum(r_idx, 0) * stride_s_n + hv * stride_s_h
    s = tl.load(r_base + offs, mask=k_read[:, None] & vmask[None, :], other=0.0)

    n_chunks = tl.where(runs, tl.cdiv(length, CHUNK), 0)
    for c in range(0, n_chunks):
        rows = start + c * CHUNK + tt
        tmask = c * CHUNK + tt < length
        qk_mask = tmask[:, None] & kmask[None, :]
        uv_mask = tmask[:, None] & vmask[None, :]
        qc = tl.load(q_ptr + rows[:, None] * stride_q_t + hk * stride_q_h + kk[None, :],
                     mask=qk_mask, other=0.0).to(tl.float32)
        kc = tl.load(k_ptr + rows[:, None] * stride_k_t + hk * stride_k_h + kk[None, :],
                     mask=qk_mask, other=0.0).to(tl.float32)
        if L2NORM:
            qc = _l2norm_rows(qc, EPS)
            kc = _l2norm_rows(kc, EPS)
        qc = qc * scale
        base = rows * num_v_heads + hv
        gcum = tl.load(gcum_ptr + base, mask=tmask, other=0.0)
        # Past the end, G stays at its last value (as if g = 0 there), so every exponent
        # below is <= 0 even in padded rows (which are never stored, but stay finite).
        n_valid = tl.minimum(length - c * CHUNK, CHUNK)
        glast = tl.sum(tl.where(tt == n_valid - 1, gcum, 0.0), axis=0)
        gcum = tl.where(tmask, gcum, glast)
        u = tl.load(u_ptr + base[:, None] * head_v + vv[None, :], mask=uv_mask, other=0.0)
        w = tl.load(w_ptr + base[:, None] * head_k + kk[None, :], mask=qk_mask, other=0.0)

        v_new = u - tl.dot(w, s, input_precision="ieee")
        att = tl.dot(qc, tl.trans(kc), input_precision="ieee")
        diff = tl.where(causal, gcum[:, None] - gcum[None, :], 0.0)
        att = tl.where(causal, att * tl.exp(diff), 0.0)
        o = tl.dot(qc * tl.exp(gcum)[:, None], s, input_precision="ieee")
        o += tl.dot(att, v_new, input_precision="ieee")
        tl.store(out_ptr + rows[:, None] * stride_o_t + hv * stride_o_h + vv[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=uv_mask)
        k_tail = kc * tl.exp(glast - gcum)[:, None]
        s = s * tl.exp(glast) + tl.dot(tl.trans(k_tail), v_new, input_precision="ieee")

    w_base = state_ptr + tl.maximum(w_idx, 0) * stride_s_n + hv * stride_s_h
    tl.store(w_base + offs, s, mask=k_run[:, None] & vmask[None, :])


def _chunk_map(cu: Sequence[int], chunk: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """First row and end row of every chunk of every sequence, as device int32 tensors."""
    starts, ends = [], []
    for lo, hi in zip(cu[:-1], cu[1:], strict=True):
        starts += range(lo, hi, chunk)
        ends += [hi] * len(range(lo, hi, chunk))
    both = on_device([starts, ends], torch.int32, device)  # no host wait
    return both[0], both[1]


def _triton_chunk(chunk_size: int, head_k: int, head_v: int) -> int:
    """The tile the Triton path uses: the requested chunk as a power of two >= 16, capped
    at 32 for 128-wide heads. The result does not depend on the chunk (the math is
    exact for any chunk); the cap is register budget: on an H200 with K = V = 128, 64-
    token tiles spill and took 28 ms for 4096 tokens x 32 heads, 32-token tiles 4 ms."""
    chunk = dot_block(chunk_size)
    return min(chunk, 32) if max(head_k, head_v) >= 128 else chunk


def chunk_gated_delta_rule(*, inputs: GatedDeltaRuleInputs) -> torch.Tensor:
    """Concatenated sequences in two launches (see the module docstring): ``[T, Hv, V]`` in
    v's dtype; the pool updated in place. ``inputs.cu_seqlens_host`` saves a device sync
    where the caller has it."""
    x = inputs
    seqs = x.sequences(chunked=True)
    assert x.cu_seqlens is not None  # checked by sequences
    q, k, v, state = x.q, x.k, x.v, x.state
    tokens, num_k_heads, head_k = k.shape
    num_v_heads, head_v = v.shape[1:]
    group = num_v_heads // num_k_heads
    g, beta = x.g.contiguous(), x.beta.contiguous()
    out = torch.zeros(tokens, num_v_heads, head_v, dtype=v.dtype, device=v.device)
    cu = list(x.cu_seqlens_host) if x.cu_seqlens_host is not None else x.cu_seqlens.tolist()
    chunk = _triton_chunk(x.chunk_size, head_k, head_v)
    chunk_row, chunk_end = _chunk_map(cu, chunk, v.device)
    if seqs == 0:
        return out
    f32 = dict(dtype=torch.float32, device=v.device)
    u = torch.empty(tokens, num_v_heads, head_v, **f32)
    w = torch.empty(tokens, num_v_heads, head_k, **f32)
    gcum = torch.empty(tokens, num_v_heads, **f32)
    tiles = torch.empty(2, max(chunk_row.numel(), 1) * num_v_heads * chunk * chunk, **f32)
    block_k = dot_block(head_k)
    warps = 8 if block_k >= 128 else 4
    if chunk_row.numel():
        _ut_kernel[(chunk_row.numel(), num_v_heads)](
            k, v, g, beta, u, w, gcum, chunk_row, chunk_end, tiles[0], tiles[1],
            head_k, head_v, group,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
            L2NORM=x.use_qk_l2norm, EPS=L2NORM_EPS,
            CHUNK=chunk, SUB=16, BLOCK_K=block_k, BLOCK_V=max(16, next_pow2(head_v)),
            num_warps=warps,
        )  # fmt: skip
    block_v = min(32, dot_block(head_v))
    _scan_kernel[(seqs, num_v_heads, triton.cdiv(head_v, block_v))](
        q, k, u, w, gcum, out, state, x.cu_seqlens, x.read_indices, x.write_indices,
        float(x.scale), head_k, head_v, group,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1),
        state.stride(0), state.stride(1), state.stride(2),
        L2NORM=x.use_qk_l2norm, EPS=L2NORM_EPS,
        CHUNK=chunk, BLOCK_K=block_k, BLOCK_V=block_v, num_warps=warps,
    )  # fmt: skip
    return out
