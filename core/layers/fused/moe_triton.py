"""Triton kernels: the experts' grouped GEMMs over expert-sorted token blocks.

Assignments (token, slot) arrive sorted by expert and padded to blocks of
``BLOCK_M`` (:mod:`kvrunner.layers.moe_align`); each program computes one block of
rows against one expert's weights, so every weight tile it streams is used by all
of that expert's tokens in the block.

1. ``gate_up``: ``x[token] @ w13[e].T`` for the gate and up halves at once (two
   accumulators over the same input tile), then SiLU-and-mul in the epilogue, with
   the torch path's roundings; rows are written at their assignment index.
2. ``down``: ``act[assignment] @ w2[e].T`` times the assignment's routing weight,
   written at its assignment index; the caller sums each token's ``top_k`` rows.

FP8 experts (``layers/fp8/experts.py``) run the same kernels weight-only (w8a16):
each program loads its e4m3 weight tile, multiplies it by the tile's 128 x 128 block
scale in float32, rounds it to the activations' dtype (as the torch path's
dequantized weights are rounded) and multiplies as a 16-bit tile would, accumulating
in float32. Half the weight bytes cross from memory, which is what a decode step of
an MoE model waits on; the activations are not quantized. A K step then stays inside
one scale block (:func:`fp8_tiles`: ``BLOCK_K`` divides 128), so each tile has one
scale per 128 of its columns.

Grids depend only on the batch shape (never on the routing), and the kernels read
the padded total from device memory, so a launch is capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrunner.layers.moe_align import ExpertBlocks


@triton.jit
def _gate_up_silu_kernel(
    x_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, total_ptr, s_ptr,
    stride_xm, stride_we, stride_wn, stride_wk, stride_om, stride_se, stride_sn, stride_sk,
    NUM_ASSIGNMENTS, TOP_K: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, W_SCALED: tl.constexpr, SCALE_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(INTER, BLOCK_N)
    pid_m, pid_n = pid // n_blocks, pid % n_blocks
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + offs_m)
    row_ok = ids < NUM_ASSIGNMENTS
    tokens = (ids // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :]
    w_base = w_ptr + expert * stride_we + offs_k[:, None] * stride_wk
    g_ptrs = w_base + offs_n[None, :] * stride_wn
    u_ptrs = w_base + (offs_n[None, :] + INTER) * stride_wn
    # FP8: the gate's scale block rows first, then the up's (layers/fp8/experts.py)
    gs_ptrs = s_ptr + expert * stride_se + (offs_n // SCALE_BLOCK) * stride_sn
    us_ptrs = gs_ptrs + tl.cdiv(INTER, SCALE_BLOCK) * stride_sn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = offs_k < H - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        g = tl.load(g_ptrs, mask=w_mask, other=0.0)
        u = tl.load(u_ptrs, mask=w_mask, other=0.0)
        if W_SCALED:  # the tile's K range lies in one scale block (BLOCK_K divides it)
            kb = (k0 // SCALE_BLOCK) * stride_sk
            g_scale = tl.load(gs_ptrs + kb, mask=col_ok, other=0.0)
            u_scale = tl.load(us_ptrs + kb, mask=col_ok, other=0.0)
            g = (g.to(tl.float32) * g_scale[None, :]).to(a.dtype)
            u = (u.to(tl.float32) * u_scale[None, :]).to(a.dtype)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    dtype = out_ptr.dtype.element_ty
    # The torch path's roundings: each projection, the SiLU, then the product.
    gate = acc_g.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    out = (act * acc_u.to(dtype).to(tl.float32)).to(dtype)
    o_ptrs = out_ptr + ids.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, out, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_weighted_kernel(
    a_ptr, w_ptr, out_ptr, topk_w_ptr, sorted_ids_ptr, block_expert_ptr, total_ptr, s_ptr,
    stride_am, stride_we, stride_wn, stride_wk, stride_om, stride_se, stride_sn, stride_sk,
    NUM_ASSIGNMENTS, H: tl.constexpr, INTER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, W_SCALED: tl.constexpr, SCALE_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(H, BLOCK_N)
    pid_m, pid_n = pid // n_blocks, pid % n_blocks
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + offs_m)
    row_ok = ids < NUM_ASSIGNMENTS
    rows = ids.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    s_ptrs = s_ptr + expert * stride_se + (offs_n // SCALE_BLOCK) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        k_ok = offs_k < INTER - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if W_SCALED:  # the tile's K range lies in one scale block (BLOCK_K divides it)
            w_scale = tl.load(s_ptrs + (k0 // SCALE_BLOCK) * stride_sk, mask=col_ok, other=0.0)
            w = (w.to(tl.float32) * w_scale[None, :]).to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(topk_w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    out = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
    o_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, out, mask=row_ok[:, None] & col_ok[None, :])


def kernel_config(num_assignments: int, num_experts: int) -> dict[str, int]:
    """Tile sizes by the mean rows per expert: thin blocks and wide K steps while each
    expert sees few tokens (decode: bandwidth-bound, many programs to spread the
    weight reads), square tiles once there are enough rows to reuse each weight tile."""
    per_expert = num_assignments / max(num_experts, 1)
    # A block should hold all of a typical expert's rows, so each expert's weights
    # stream from memory once: BLOCK_M about twice the mean (counts vary by expert).
    if per_expert <= 4:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3)
    if per_expert <= 8:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    if per_expert <= 20:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    if per_expert <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def fp8_tiles(config: dict[str, int], scale_block: int) -> dict[str, int]:
    """``config`` for FP8 experts whose scales cover ``scale_block`` columns each: a K
    step of at most one scale block, so every weight tile has one scale per
    ``scale_block`` of its columns (the other tile sizes as chosen)."""
    return {**config, "BLOCK_K": min(config["BLOCK_K"], scale_block)}


def _launch_kw(config: dict[str, int], x: torch.Tensor) -> dict:
    kw = dict(config)
    if not x.is_cuda:  # the interpreter takes no pipelining hints
        kw.pop("num_stages"), kw.pop("num_warps")
    # float32 stays float32 (no TF32): it is the dtype the tests compare exactly.
    kw["PRECISION"] = "ieee" if x.dtype == torch.float32 else "tf32"
    return kw


def grouped_experts_triton(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    blocks: ExpertBlocks, config: dict[str, int],
    scales: tuple[torch.Tensor, torch.Tensor] | None = None, scale_block: int | None = None,
) -> torch.Tensor:
    """``[T, H]`` -> ``[T, top_k, H]``: each assignment's weighted expert output.

    ``w13``: ``[E, 2I, H]`` (gate rows, then up rows); ``w2``: ``[E, H, I]``;
    ``blocks`` aligned with ``config["BLOCK_M"]``. ``scales``: FP8 experts' ``(w13_scale_inv,
    w2_scale_inv)`` (``layers/fp8/experts.py``), the weights then ``float8_e4m3fn`` and
    ``scale_block`` the columns each scale covers (``layers/fp8/blocks.py``'s ``BLOCK``)
    and ``config["BLOCK_K"]`` a divisor of it (:func:`fp8_tiles`).
    """
    t, h = x.shape
    top_k = topk_weights.shape[1]
    i = w2.shape[2]
    n = blocks.num_assignments
    out = torch.empty(t, top_k, h, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    if scales is not None and scale_block is None:
        raise ValueError("FP8 experts need the scale_block their scales cover")
    if scales is not None and scale_block % config["BLOCK_K"]:
        raise ValueError(f"FP8 experts need BLOCK_K dividing {scale_block}, got "
                         f"{config['BLOCK_K']} (see fp8_tiles)")
    # unscaled weights pass themselves as the (never read) scales
    s13, s2 = scales if scales is not None else (w13, w2)
    x = x if x.stride(-1) == 1 else x.contiguous()
    act = torch.empty(n, i, dtype=x.dtype, device=x.device)
    kw = _launch_kw(config, x)
    kw.update(W_SCALED=scales is not None, SCALE_BLOCK=scale_block or 1)
    m_blocks = blocks.block_expert.numel()
    _gate_up_silu_kernel[(m_blocks * triton.cdiv(i, config["BLOCK_N"]),)](
        x, w13, act, blocks.sorted_ids, blocks.block_expert, blocks.total_padded, s13,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0),
        s13.stride(0), s13.stride(1), s13.stride(2),
        n, TOP_K=top_k, H=h, INTER=i, **kw,
    )
    flat_out = out.view(n, h)
    _down_weighted_kernel[(m_blocks * triton.cdiv(h, config["BLOCK_N"]),)](
        act, w2, flat_out, topk_weights.reshape(-1), blocks.sorted_ids, blocks.block_expert,
        blocks.total_padded, s2, act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2),
        flat_out.stride(0), s2.stride(0), s2.stride(1), s2.stride(2), n, H=h, INTER=i, **kw,
    )
    return out
