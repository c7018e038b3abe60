"""Causal depthwise conv1d for prefill over concatenated (varlen) sequences.

Sequence ``s`` owns rows ``cu_seqlens[s]:cu_seqlens[s+1]`` of ``x [T, D]``. Its left
context is ``conv_state[read[s]]`` (the previous ``K - 1`` inputs) when
``read[s] >= 0`` and zeros otherwise; after the step, the last ``K - 1`` inputs of
``[left context, x_s]`` are written to ``conv_state[write[s]]``. A sequence whose
write index is < 0 reads nothing, writes nothing and outputs zeros.

The Triton path is two launches: outputs first (they read the old state as left
context), then the state write-back. One launch could not do both without a
race between a program still reading the old window and another overwriting it.
:func:`conv1d_prefill_split_triton` cuts the output into column sections, each its own
dense tensor (q, k and v for fla's kernels), with one output launch per section.
"""

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kvrunner_gdn.kernels.common import next_pow2
from kvrunner_gdn.kernels.conv_torch import check_prefill, conv1d_prefill_torch


@triton.jit
def _conv_prefill_out_kernel(
    x_ptr, out_ptr, state_ptr, w_ptr, b_ptr, cu_ptr, read_ptr, write_ptr,
    dim,
    stride_x_t, stride_o_t,
    stride_s_n, stride_s_d, stride_s_w,
    stride_w_d, stride_w_k,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    start = tl.load(cu_ptr + seq).to(tl.int64)
    length = tl.load(cu_ptr + seq + 1).to(tl.int64) - start
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < dim
    w_idx = tl.load(write_ptr + seq).to(tl.int64)
    r_idx = tl.load(read_ptr + seq).to(tl.int64)
    runs = w_idx >= 0
    reads = runs & (r_idx >= 0)
    tmask = t < length
    # Per-sequence conditions folded into bounds (see conv_update for why).
    t_run = t < tl.where(runs, length, 0)
    d_read = d < tl.where(reads, dim, 0)
    r_base = state_ptr + tl.maximum(r_idx, 0) * stride_s_n + d[None, :] * stride_s_d

    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        # Tap j sees the input at relative position t - (WIDTH - 1) + j; a negative
        # position is column (WIDTH - 1) + pos of the left-context state.
        pos = t + j - (WIDTH - 1)
        in_x = pos >= 0
        xm = t_run[:, None] & in_x[:, None] & dmask[None, :]
        xv = tl.load(
            x_ptr + (start + tl.maximum(pos, 0))[:, None] * stride_x_t + d[None, :],
            mask=xm, other=0.0,
        ).to(tl.float32)
        sm = tmask[:, None] & (pos < 0)[:, None] & d_read[None, :]
        col = tl.maximum(pos + (WIDTH - 1), 0)
        sv = tl.load(r_base + col[:, None] * stride_s_w, mask=sm, other=0.0)
        wj = tl.load(w_ptr + d * stride_w_d + j * stride_w_k, mask=dmask, other=0.0)
        acc += tl.where(in_x[:, None], xv, sv) * wj.to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    acc = tl.where(runs, acc, 0.0)
    o_ptrs = out_ptr + (start + t)[:, None] * stride_o_t + d[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & dmask[None, :])


@triton.jit
def _conv_prefill_state_kernel(
    x_ptr, state_ptr, cu_ptr, read_ptr, write_ptr,
    dim,
    stride_x_t,
    stride_s_n, stride_s_d, stride_s_w,
    WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    start = tl.load(cu_ptr + seq).to(tl.int64)
    length = tl.load(cu_ptr + seq + 1).to(tl.int64) - start
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    c = tl.arange(0, BLOCK_W)
    w_idx = tl.load(write_ptr + seq).to(tl.int64)
    r_idx = tl.load(read_ptr + seq).to(tl.int64)
    runs = w_idx >= 0
    reads = runs & (r_idx >= 0)
    cmask = c < WIDTH - 1
    d_run = d < tl.where(runs, dim, 0)
    d_read = d < tl.where(reads, dim, 0)
    # New column c holds relative position length - (WIDTH - 1) + c: from x when that
    # is >= 0, else from the old state (short sequences keep part of their history).
    pos = length - (WIDTH - 1) + c
    in_x = pos >= 0
    xm = d_run[None, :] & (cmask & in_x)[:, None]
    xv = tl.load(x_ptr + (start + tl.maximum(pos, 0))[:, None] * stride_x_t + d[None, :], mask=xm,
                 other=0.0).to(tl.float32)
    col = tl.maximum(pos + (WIDTH - 1), 0)
    sm = d_read[None, :] & (cmask & (pos < 0))[:, None]
    r_base = state_ptr + tl.maximum(r_idx, 0) * stride_s_n
    sv = tl.load(r_base + d[None, :] * stride_s_d + col[:, None] * stride_s_w, mask=sm, other=0.0)
    new = tl.where(in_x[:, None], xv, sv)
    w_base = state_ptr + tl.maximum(w_idx, 0) * stride_s_n
    tl.store(w_base + d[None, :] * stride_s_d + c[:, None] * stride_s_w, new,
             mask=d_run[None, :] & cmask[:, None])


def conv1d_prefill_triton(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    read_indices: torch.Tensor,
    write_indices: torch.Tensor,
    max_seqlen: int,
    activation: bool = True,
) -> torch.Tensor:
    """Triton launcher; ``max_seqlen`` (a host int) sizes the grid. Rows of ``x`` past
    ``cu_seqlens[-1]`` come back as zeros."""
    (out,) = conv1d_prefill_split_triton(x, conv_state, weight, bias, cu_seqlens, read_indices,
                                         write_indices, max_seqlen, (x.shape[1],), activation)
    return out


def conv1d_prefill_split_triton(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    read_indices: torch.Tensor,
    write_indices: torch.Tensor,
    max_seqlen: int,
    sections: Sequence[int],
    activation: bool = True,
) -> tuple[torch.Tensor, ...]:
    """:func:`conv1d_prefill_triton` with the output's channels cut into ``sections``
    (widths summing to ``D``), each its own contiguous ``[T, width]`` tensor: the same
    values as the ``[T, D]`` output's column slices, bit for bit. A kernel that indexes
    dense tensors (fla's) then takes q, k and v without a copy each. One output launch
    per section (the kernel takes any column window through its strides and pointers),
    then the state write-back once, after every output has read the old window."""
    seqs = check_prefill(x, conv_state, weight, cu_seqlens, read_indices, write_indices)
    dim = x.shape[1]
    if sum(sections) != dim or any(w <= 0 for w in sections):
        raise ValueError(f"sections {tuple(sections)} must be positive and sum to {dim}")
    width = weight.shape[1]
    outs = tuple(x.new_zeros(x.shape[0], w) for w in sections)
    if seqs == 0 or max_seqlen == 0:
        return outs
    block_d = min(64, next_pow2(dim))
    block_t = min(64, next_pow2(max_seqlen))
    start = 0
    for out in outs:
        cols = slice(start, start + out.shape[1])
        start = cols.stop
        w, st = weight[cols], conv_state[:, cols]
        b = bias[cols] if bias is not None else w
        grid = (seqs, triton.cdiv(max_seqlen, block_t), triton.cdiv(out.shape[1], block_d))
        _conv_prefill_out_kernel[grid](
            x[:, cols], out, st, w, b, cu_seqlens, read_indices, write_indices,
            out.shape[1], x.stride(0), out.stride(0),
            st.stride(0), st.stride(1), st.stride(2),
            w.stride(0), w.stride(1),
            WIDTH=width, HAS_BIAS=bias is not None, SILU=activation,
            BLOCK_T=block_t, BLOCK_D=block_d,
        )  # fmt: skip
    _conv_prefill_state_kernel[(seqs, triton.cdiv(dim, block_d))](
        x, conv_state, cu_seqlens, read_indices, write_indices,
        dim, x.stride(0),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        WIDTH=width, BLOCK_D=block_d, BLOCK_W=next_pow2(max(width - 1, 1)),
    )  # fmt: skip
    return outs


def conv1d_prefill(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    read_indices: torch.Tensor,
    write_indices: torch.Tensor,
    max_seqlen: int,
    activation: bool = True,
    use_triton: bool = True,
) -> torch.Tensor:
    """Prefill conv: ``x [T, D]`` -> ``[T, D]`` (dtype of ``x``); ``conv_state`` updated."""
    impl = conv1d_prefill_triton if use_triton else conv1d_prefill_torch
    return impl(x, conv_state, weight, bias, cu_seqlens, read_indices, write_indices,
                max_seqlen, activation)
