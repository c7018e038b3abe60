"""The store in Triton: write this step's keys and values into the paged pool.

One program per token row. The row's slot comes from ``slot_mapping``; a slot < 0
(``PAD_SLOT_ID``) masks every load and store of the program, so a padded row or a
capture over a blanked ``slot_mapping`` touches no cache byte at all.

:func:`store_newest_kv` is the same write for one decode row and KV head, called from
inside the attention kernels that store as they attend (the inputs' ``new_kv``: the
decode and fixed-order kernels), so that a decode step needs no launch of its own for
it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrunner_paged.kv_format import FP8_MAX, is_fp8
from kvrunner_paged.ops.head_scales import inverse_scales, table_for
from kvrunner_paged.ops.paged_attention.inputs import NewKV
from kvrunner_paged.ops.utils import unit_last_dim

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def to_cache(x, inv_scale, cache_ptr, QUANTIZE: tl.constexpr):
    """``x`` as the pool at ``cache_ptr`` stores it: cast, or quantized to FP8."""
    if QUANTIZE:
        x = tl.clamp(x.to(tl.float32) * inv_scale, -_FP8_MAX, _FP8_MAX,
                     propagate_nan=tl.PropagateNan.ALL)
        return x.to(cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    scales_ptr,
    scale_row_stride,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANTIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    valid = slot >= 0
    # Keep the address arithmetic in range even for a PAD row: its mask is all false,
    # but an address computed from a negative slot is never formed in the first place.
    safe_slot = tl.where(valid, slot, 0)
    block = safe_slot // block_size
    offset = safe_slot % block_size

    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # ``valid`` is broadcast through a tensor-valued comparison (not combined as a
    # scalar), which both the compiler and the interpreter accept as a mask.
    row_slot = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64) + slot
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM) & (row_slot >= 0)

    k_inv_scale, v_inv_scale = inverse_scales(scales_ptr, scale_row_stride, heads,
                                              heads < NUM_KV_HEADS, QUANTIZE)
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
    v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot
    tl.store(k_dst + heads * stride_kc_head + dims, to_cache(k, k_inv_scale, k_cache_ptr, QUANTIZE),
             mask=mask)
    tl.store(v_dst + heads * stride_vc_head + dims, to_cache(v, v_inv_scale, v_cache_ptr, QUANTIZE),
             mask=mask)


@triton.jit
def store_newest_kv(
    row, kv_head, newest, lo, hi,
    k_new_ptr, v_new_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    k_inv_scale, v_inv_scale,
    stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    block_size,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANTIZE: tl.constexpr,
):
    """One decode row's key and value of one KV head, written to the row's slot, from
    inside the decode kernel: only by the program whose key slice ``[lo, hi)`` holds
    position ``newest``, and not at all for a PAD slot."""
    dims = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    # Tensor-valued masks, not scalar ones: the compiler and the interpreter both take them.
    newest_d = tl.zeros([BLOCK_D], dtype=tl.int32) + newest
    slot_d = tl.zeros([BLOCK_D], dtype=tl.int64) + slot
    writes = (dims < HEAD_DIM) & (newest_d >= lo) & (newest_d < hi) & (slot_d >= 0)
    safe = tl.where(slot >= 0, slot, 0)  # a PAD row forms its (unused) address from slot 0
    block, offset = safe // block_size, safe % block_size
    k = tl.load(k_new_ptr + row * stride_knt + kv_head * stride_knh + dims, mask=writes)
    v = tl.load(v_new_ptr + row * stride_vnt + kv_head * stride_vnh + dims, mask=writes)
    k_dst = k_cache_ptr + block * stride_kb + offset * stride_ks + kv_head * stride_kh
    v_dst = v_cache_ptr + block * stride_vb + offset * stride_vs + kv_head * stride_vh
    tl.store(k_dst + dims, to_cache(k, k_inv_scale, k_cache_ptr, QUANTIZE), mask=writes)
    tl.store(v_dst + dims, to_cache(v, v_inv_scale, v_cache_ptr, QUANTIZE), mask=writes)


def newest_kv_args(
    new_kv: NewKV | None, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``(k, v, slot_mapping)`` a launch that stores as it attends passes to
    :func:`store_newest_kv` (checked against ``q``'s rows by the inputs record); without
    ``new_kv``, placeholders the kernel never dereferences (its store is compiled out)."""
    if new_kv is None:
        return q, q, q
    return new_kv.k, new_kv.v, new_kv.slot_mapping


def store_kv(*, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, scales: torch.Tensor | None = None) -> None:
    """Write ``k[t]``/``v[t]`` to slot ``slot_mapping[t]``; rows with a slot < 0 write nothing.
    Into FP8 caches the rows go quantized by the layer's scale table ``scales``
    (``[4, num_kv_heads]``, :func:`~kvrunner_paged.kv_format.scale_table`; None: 1.0),
    each KV head times its reciprocal scale, read on the device.

    :param k: ``[num_tokens, num_kv_heads, head_dim]``; any token/head strides (``v`` too).
    :param k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (``v_cache`` too).
    :param slot_mapping: ``[>= num_tokens]`` integer; slot ``s`` is block
        ``s // block_size``, offset ``s % block_size``.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = unit_last_dim(k), unit_last_dim(v)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache head_dim must be contiguous"
    table, row_stride = table_for(scales, k_cache)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        table,
        row_stride,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANTIZE=is_fp8(k_cache),
    )
