"""The causal depthwise conv for prefill over concatenated (varlen) sequences, in Triton.

Sequence ``s`` owns rows ``cu_seqlens[s]:cu_seqlens[s+1]`` of ``x [T, D]``. Its left
context is ``conv_state[read[s]]`` (the previous ``K - 1`` inputs) when
``read[s] >= 0`` and zeros otherwise; after the step, the last ``K - 1`` inputs of
``[left context, x_s]`` are written to ``conv_state[write[s]]``. A sequence whose
write index is < 0 reads nothing, writes nothing and outputs zeros.

The Triton path is two launches: outputs first (they read the old state as left
context), then the state write-back. One launch could not do both without a
race between a program still reading the old window and another overwriting it.
:func:`short_conv_prefill_split` cuts the output into column sections, each its own
dense tensor (q, k and v for fla's kernels), in the same single output launch.
"""

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvrunner_gdn.ops.short_conv.inputs import ShortConvInputs
from kvrunner_gdn.ops.slots_triton import row_slots
from kvrunner_gdn.ops.utils import next_pow2


@triton.jit
def _conv_prefill_out_kernel(
    x_ptr, out_ptr, out1_ptr, out2_ptr, state_ptr, w_ptr, b_ptr, cu_ptr, read_ptr, write_ptr,
    dim, split1, split2,
    stride_x_t, stride_o_t, stride_o1_t, stride_o2_t,
    stride_s_n, stride_s_d, stride_s_w,
    stride_w_d, stride_w_k,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, SECTIONS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, CHANNELS_FASTEST: tl.constexpr,
):  # fmt: skip
    if CHANNELS_FASTEST:  # neighbouring programs: neighbouring channels of the same rows
        seq, d_block = tl.program_id(2), tl.program_id(0)
    else:  # neighbouring programs: neighbouring token tiles of the same channels
        seq, d_block = tl.program_id(0), tl.program_id(2)
    start = tl.load(cu_ptr + seq).to(tl.int64)
    length = tl.load(cu_ptr + seq + 1).to(tl.int64) - start
    t0 = tl.program_id(1) * BLOCK_T
    if t0 >= length:  # the grid covers the longest sequence
        return
    t = t0 + tl.arange(0, BLOCK_T)
    d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < dim
    w_idx = tl.load(write_ptr + seq).to(tl.int64)
    r_idx = tl.load(read_ptr + seq).to(tl.int64)
    runs = w_idx >= 0
    tmask = t < length
    # Per-sequence conditions folded into bounds (see slots_triton for why).
    t_run = t < tl.where(runs, length, 0)
    # Row pointers once; tap j reads them shifted by a compile-time number of rows.
    x_rows = x_ptr + (start + t)[:, None] * stride_x_t + d[None, :]

    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        # Tap j sees the input at relative position t - (WIDTH - 1) + j.
        pos = t + j - (WIDTH - 1)
        xm = (t_run & (pos >= 0))[:, None] & dmask[None, :]
        xv = tl.load(x_rows + (j - (WIDTH - 1)) * stride_x_t, mask=xm, other=0.0)
        wj = tl.load(w_ptr + d * stride_w_d + j * stride_w_k, mask=dmask, other=0.0)
        acc += xv.to(tl.float32) * wj.to(tl.float32)[None, :]
    if (t0 < WIDTH - 1) & runs & (r_idx >= 0):
        # Only a sequence's first tile sees its left context: a negative position is
        # column (WIDTH - 1) + pos of the state, read for taps that reach back that far.
        r_base = state_ptr + r_idx * stride_s_n + d[None, :] * stride_s_d
        for j in tl.static_range(WIDTH - 1):
            pos = t + j - (WIDTH - 1)
            sm = (tmask & (pos < 0))[:, None] & dmask[None, :]
            col = tl.maximum(pos + (WIDTH - 1), 0)
            sv = tl.load(r_base + col[:, None] * stride_s_w, mask=sm, other=0.0)
            wj = tl.load(w_ptr + d * stride_w_d + j * stride_w_k, mask=dmask, other=0.0)
            acc += sv.to(tl.float32) * wj.to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    acc = tl.where(runs, acc, 0.0)
    rows = (start + t)[:, None]
    if SECTIONS == 1:
        tl.store(out_ptr + rows * stride_o_t + d[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=tmask[:, None] & dmask[None, :])
    else:
        # Each column goes to its section's tensor; a tile inside one section masks off
        # the others' stores entirely.
        tl.store(out_ptr + rows * stride_o_t + d[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=tmask[:, None] & (d < split1)[None, :])
        in1 = (d >= split1) & (d < split2)
        tl.store(out1_ptr + rows * stride_o1_t + (d - split1)[None, :],
                 acc.to(out1_ptr.dtype.element_ty), mask=tmask[:, None] & in1[None, :])
        if SECTIONS == 3:
            tl.store(out2_ptr + rows * stride_o2_t + (d - split2)[None, :],
                     acc.to(out2_ptr.dtype.element_ty),
                     mask=tmask[:, None] & ((d >= split2) & dmask)[None, :])


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
    w_idx, r_idx, runs, d_run_bound, d_read_bound = row_slots(read_ptr, write_ptr, seq, dim)
    cmask = c < WIDTH - 1
    d_run = d < d_run_bound
    d_read = d < d_read_bound
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


class ConvTiles(NamedTuple):
    """The output launch's shape: a speed choice only, every one gives the same bytes."""

    tokens: int  #: BLOCK_T
    channels: int  #: BLOCK_D
    warps: int
    #: program order: channel blocks of the same rows next to each other (the layout's
    #: rows are contiguous), else token tiles of the same channels
    channels_fastest: bool = False


def default_conv_tiles(dim: int, max_seqlen: int) -> ConvTiles:
    """The output launch's tile: 16 tokens by 128 channels, four warps, capped at the
    problem's own size. At Qwen3-Next's 8,192 channels on an H200, fresh and continuing,
    78 us against 94 for 64 x 64, within 5% of the fastest tile swept
    (``benchmarks/bench_gdn_conv.py --sweep``: 75 us for 8 x 128 with two warps; with
    channels first, which moved a tile by -8 to +2 us, 74 us for 16 x 32 with one)."""
    return ConvTiles(min(16, next_pow2(max_seqlen)), min(128, next_pow2(dim)), 4)


def short_conv_prefill(*, inputs: ShortConvInputs, tiles: ConvTiles | None = None) -> torch.Tensor:
    """Concatenated sequences: ``[T, D]`` in x's dtype, rows past ``cu_seqlens[-1]`` zero;
    the pool updated in place. ``inputs.max_seqlen`` (a host int) sizes the grid;
    ``tiles`` (a :class:`ConvTiles`, or the tuple of its fields) overrides
    :func:`default_conv_tiles`."""
    (out,) = short_conv_prefill_split(inputs=inputs, sections=(inputs.x.shape[1],), tiles=tiles)
    return out


def short_conv_prefill_split(*, inputs: ShortConvInputs, sections: Sequence[int],
                             tiles: ConvTiles | None = None) -> tuple[torch.Tensor, ...]:
    """:func:`short_conv_prefill` with the output's channels cut into one to three
    ``sections`` (widths summing to ``D``), each its own contiguous ``[T, width]``
    tensor: the same values as the ``[T, D]`` output's column slices, bit for bit. A
    kernel that indexes dense tensors (fla's) then takes q, k and v without a copy each.
    One output launch stores each column into its section's tensor, then the state
    write-back runs once, after every output has read the old window."""
    c = inputs
    seqs = c.sequences(varlen=True)
    if c.max_seqlen is None:
        raise ValueError("the Triton prefill conv needs max_seqlen (it sizes the grid)")
    x, state, weight, bias, max_seqlen = c.x, c.conv_state, c.weight, c.bias, c.max_seqlen
    dim = x.shape[1]
    if sum(sections) != dim or any(w <= 0 for w in sections) or not 1 <= len(sections) <= 3:
        raise ValueError(f"sections {tuple(sections)} must be one to three positive widths "
                         f"that sum to {dim}")
    # Every row of the output is written when the sequences cover every row of x.
    alloc = x.new_empty if c.total_tokens == x.shape[0] else x.new_zeros
    outs = tuple(alloc(x.shape[0], w) for w in sections)
    if seqs == 0 or max_seqlen == 0:
        return outs
    width = weight.shape[1]
    block_t, block_d, warps, channels_fastest = ConvTiles(
        *(tiles or default_conv_tiles(dim, max_seqlen)))
    splits = [sum(sections[:i + 1]) for i in range(len(sections))] + [dim, dim]
    padded = (*outs, outs[-1], outs[-1])  # unused pointers of fewer sections: never stored
    b = bias if bias is not None else weight  # a pointer HAS_BIAS=False never reads
    grid = (seqs, triton.cdiv(max_seqlen, block_t), triton.cdiv(dim, block_d))
    if channels_fastest:
        grid = grid[::-1]
    _conv_prefill_out_kernel[grid](
        x, padded[0], padded[1], padded[2], state, weight, b,
        c.cu_seqlens, c.read_indices, c.write_indices,
        dim, splits[0], splits[1],
        x.stride(0), padded[0].stride(0), padded[1].stride(0), padded[2].stride(0),
        state.stride(0), state.stride(1), state.stride(2),
        weight.stride(0), weight.stride(1),
        WIDTH=width, HAS_BIAS=bias is not None, SILU=c.activation, SECTIONS=len(sections),
        BLOCK_T=block_t, BLOCK_D=block_d, CHANNELS_FASTEST=channels_fastest, num_warps=warps,
    )  # fmt: skip
    state_block = min(64, next_pow2(dim))
    _conv_prefill_state_kernel[(seqs, triton.cdiv(dim, state_block))](
        x, state, c.cu_seqlens, c.read_indices, c.write_indices,
        dim, x.stride(0),
        state.stride(0), state.stride(1), state.stride(2),
        WIDTH=width, BLOCK_D=state_block, BLOCK_W=next_pow2(max(width - 1, 1)),
    )  # fmt: skip
    return outs
