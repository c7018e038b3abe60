"""The causal depthwise conv for decode, in Triton: one new token per sequence, state
updated in place.

For row ``b`` the window is ``[state[read[b]] (K-1 columns, oldest first), x[b]]``;
the output is ``silu(sum(window * weight, -1) + bias)`` and the last ``K - 1``
columns of the window become ``state[write[b]]``. Rows whose write index is < 0
(PAD) read nothing, write nothing and output zeros; a read index < 0 means "no
history" (zeros), which is how a sequence starting at position 0 ignores whatever
its slot held before.
"""

import torch
import triton
import triton.language as tl

from kvrunner_gdn.ops.short_conv.inputs import ShortConvInputs
from kvrunner_gdn.ops.slots_triton import row_slots
from kvrunner_gdn.ops.utils import next_pow2


@triton.jit
def _conv_update_kernel(
    x_ptr, out_ptr, state_ptr, w_ptr, b_ptr, read_ptr, write_ptr,
    dim,
    stride_x_t, stride_o_t,
    stride_s_n, stride_s_d, stride_s_w,
    stride_w_d, stride_w_k,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cols = tl.arange(0, BLOCK_W)
    dmask = d < dim
    w_idx, r_idx, runs, d_run_bound, d_read_bound = row_slots(read_ptr, write_ptr, row, dim)
    d_run = d < d_run_bound  # empty for a PAD row
    d_read = d < d_read_bound  # also without history
    # Clamp before forming addresses so a PAD row never builds a negative pointer.
    r_base = state_ptr + tl.maximum(r_idx, 0) * stride_s_n + d[:, None] * stride_s_d
    w_base = state_ptr + tl.maximum(w_idx, 0) * stride_s_n + d[:, None] * stride_s_d

    xv = tl.load(x_ptr + row * stride_x_t + d, mask=d_run, other=0.0).to(tl.float32)
    hist_mask = d_read[:, None] & (cols[None, :] < WIDTH - 1)
    hist = tl.load(r_base + cols[None, :] * stride_s_w, mask=hist_mask, other=0.0)
    window = tl.where(cols[None, :] == WIDTH - 1, xv[:, None], hist)
    wmask = dmask[:, None] & (cols[None, :] < WIDTH)
    w = tl.load(w_ptr + d[:, None] * stride_w_d + cols[None, :] * stride_w_k, mask=wmask, other=0.0)
    acc = tl.sum(window * w.to(tl.float32), axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    acc = tl.where(runs, acc, 0.0)
    tl.store(out_ptr + row * stride_o_t + d, acc.to(out_ptr.dtype.element_ty), mask=dmask)

    # New state column c is window column c + 1: shift by loading one column later.
    # Both loads of the old state precede this store, so read == write slots are safe.
    shift_mask = d_read[:, None] & (cols[None, :] + 1 < WIDTH - 1)
    shifted = tl.load(r_base + (cols[None, :] + 1) * stride_s_w, mask=shift_mask, other=0.0)
    new_state = tl.where(cols[None, :] + 1 == WIDTH - 1, xv[:, None], shifted)
    store_mask = d_run[:, None] & (cols[None, :] < WIDTH - 1)
    tl.store(w_base + cols[None, :] * stride_s_w, new_state, mask=store_mask)


def short_conv_update(*, inputs: ShortConvInputs) -> torch.Tensor:
    """One new token per sequence: ``[B, D]`` in x's dtype; the pool updated in place.
    Graph-capturable (no host syncs)."""
    c = inputs
    rows = c.sequences(varlen=False)
    x, state, weight = c.x, c.conv_state, c.weight
    dim = x.shape[1]
    out = torch.empty_like(x)
    if rows == 0:
        return out
    block_d = min(128, next_pow2(dim))
    grid = (rows, triton.cdiv(dim, block_d))
    _conv_update_kernel[grid](
        x, out, state, weight, c.bias if c.bias is not None else weight,
        c.read_indices, c.write_indices,
        dim,
        x.stride(0), out.stride(0),
        state.stride(0), state.stride(1), state.stride(2),
        weight.stride(0), weight.stride(1),
        WIDTH=weight.shape[1], HAS_BIAS=c.bias is not None, SILU=c.activation,
        BLOCK_D=block_d, BLOCK_W=next_pow2(weight.shape[1]),
    )  # fmt: skip
    return out
