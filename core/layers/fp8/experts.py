"""The mixture-of-experts layer's FP8 storage: every expert's weights stacked in
``float8_e4m3fn`` beside float32 scales per 128 x 128 block, and how one expert's
checkpoint tensor loads into them.

Qwen's FP8 MoE checkpoints store each expert's projections as the dense ones are
stored (``experts.{e}.gate_proj.weight`` in e4m3 beside its ``weight_scale_inv``),
so each projection has its own blocks. The stacked layout keeps them:

* ``w13`` ``[E, 2I, H]`` (the gate's rows, then the up's) beside ``w13_scale_inv``
  ``[E, 2 * cdiv(I, 128), cdiv(H, 128)]``: the gate's block rows, then the up's. A
  gate row ``n`` has its scales at block row ``n // 128``, an up row ``n`` at
  ``cdiv(I, 128) + n // 128``, so an ``I`` that is not a multiple of 128 loads too
  (each half's last block row is partial, as in the checkpoint);
* ``w2`` ``[E, H, I]`` beside ``w2_scale_inv`` ``[E, cdiv(H, 128), cdiv(I, 128)]``.

Under tensor parallelism each rank holds ``I / tp`` of every expert's rows (``w13``)
and columns (``w2``), so each rank's slice must start on a block boundary:
:func:`~kvrunner.layers.fp8.weights.check_part_alignment` refuses the layer when it is
built otherwise. What arrives for a weight decides what a load does, as for a dense
FP8 linear (``weights.py``): a float tensor is quantized by its own blocks into the
bytes and the scales, an FP8 tensor's bytes are placed as they are (its scales arrive
under their own name), an integer tensor (the checksum's position probe) is placed as
the values would be.
"""

from __future__ import annotations

import torch
from torch import nn

from kvrunner.layers.fp8.blocks import (
    BLOCK,
    FP8_DTYPE,
    cdiv,
    dequantize_blocks,
    is_fp8,
    quantize_blocks,
)
from kvrunner.layers.fp8.weights import SCALE_SUFFIX, check_part_alignment, quantize_blocks_into
from kvrunner.layers.weight_copy import copy_weight_

#: each stacked weight's scales parameter, by the weight's name (``w13`` -> ``w13_scale_inv``)
SCALE_PARAMS = {"w13": "w13_scale_inv", "w2": "w2_scale_inv"}


def expert_scale_shapes(num_experts: int, hidden: int, i_local: int
                        ) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """``(w13_scale_inv, w2_scale_inv)`` shapes for ``num_experts`` experts of this
    rank's ``i_local`` rows (see the module docstring)."""
    ib, hb = cdiv(i_local, BLOCK), cdiv(hidden, BLOCK)
    return (num_experts, 2 * ib, hb), (num_experts, hb, ib)


def make_fp8_expert_params(moe: nn.Module, num_experts: int, hidden: int, i_local: int,
                           device: torch.device | str) -> None:
    """Give ``moe`` (a :class:`~kvrunner.layers.moe.FusedMoE` being built) FP8 ``w13`` and
    ``w2`` and their scales, every one a parameter loaded through ``moe.weight_loader``;
    the scales' checkpoint names are each expert projection's ``weight_scale_inv``."""
    if moe.tp.size > 1:
        check_part_alignment(f"{type(moe).__name__} (moe_intermediate_size / tp)",
                             [r * i_local for r in range(moe.tp.size)])
    moe.w13 = nn.Parameter(torch.empty(num_experts, 2 * i_local, hidden, dtype=FP8_DTYPE,
                                       device=device), requires_grad=False)
    moe.w2 = nn.Parameter(torch.empty(num_experts, hidden, i_local, dtype=FP8_DTYPE,
                                      device=device), requires_grad=False)
    s13, s2 = expert_scale_shapes(num_experts, hidden, i_local)
    moe.w13_scale_inv = nn.Parameter(torch.ones(s13, dtype=torch.float32, device=device),
                                     requires_grad=False)
    moe.w2_scale_inv = nn.Parameter(torch.ones(s2, dtype=torch.float32, device=device),
                                    requires_grad=False)
    moe.w13_scale_inv.checkpoint_shards = {
        f"{e}.{proj}.{SCALE_SUFFIX}": (part, e)
        for e in range(num_experts) for part, proj in (("gate", "gate_proj"), ("up", "up_proj"))
    }
    moe.w2_scale_inv.checkpoint_shards = {
        f"{e}.down_proj.{SCALE_SUFFIX}": ("down", e) for e in range(num_experts)
    }
    for name, scale_name in SCALE_PARAMS.items():
        # a float tensor loaded into the weight writes these scales too (models/weight_names.py)
        getattr(moe, name).fp8_scale_name = scale_name
        getattr(moe, scale_name).weight_loader = moe.weight_loader


def is_scale_target(param: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether a load into ``param`` (the weight, its scales, or a twin of either: a meta
    one for a dry run, an integer one for the checksum) places scales."""
    return tuple(param.shape) == tuple(scale.shape) and tuple(scale.shape) != tuple(weight.shape)


def load_expert_weight(target: torch.Tensor, scale_target: torch.Tensor | None,
                       piece: torch.Tensor, *, what: str) -> None:
    """Place this rank's ``piece`` of one expert projection at ``target`` (rows of the
    FP8 weight, or of a twin of it); a float piece is quantized by its own blocks and
    its scales written at ``scale_target`` (None for a twin, which takes no scales)."""
    if tuple(target.shape) != tuple(piece.shape):
        raise ValueError(f"{what}: expected shape {tuple(target.shape)}, "
                         f"got {tuple(piece.shape)}")
    if target.is_meta or not target.is_floating_point() or is_fp8(piece):
        copy_weight_(target, piece, what=what)  # shapes only / positions / bytes as stored
        return
    quantize_blocks_into(piece.to(target.device), target, scale_target)


def scale_piece(loaded: torch.Tensor, *, part: str, rank: int, ib_local: int,
                hidden: int, tp_size: int, what: str) -> torch.Tensor:
    """This rank's blocks of one expert projection's full ``weight_scale_inv``:
    ``[cdiv(I, 128), cdiv(H, 128)]`` for gate and up (its rows), ``[cdiv(H, 128),
    cdiv(I, 128)]`` for down (its columns)."""
    ib_full, hb = ib_local * tp_size, cdiv(hidden, BLOCK)
    want = (hb, ib_full) if part == "down" else (ib_full, hb)
    if tuple(loaded.shape) != want:
        raise ValueError(f"{what}: expected shape {want}, got {tuple(loaded.shape)}")
    dim = 1 if part == "down" else 0
    return loaded.narrow(dim, rank * ib_local, ib_local)


def dequantize_experts(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                       w2_scale: torch.Tensor, dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The stacked FP8 experts as ``dtype`` weights of the same layout, each block times
    its scale in float32 (the torch path's weights, and the tests' oracle)."""
    i = w2.shape[2]
    ib = cdiv(i, BLOCK)
    gate = dequantize_blocks(w13[:, :i], w13_scale[:, :ib], dtype)
    up = dequantize_blocks(w13[:, i:], w13_scale[:, ib:], dtype)
    return torch.cat([gate, up], dim=1), dequantize_blocks(w2, w2_scale, dtype)


def quantize_experts(w13: torch.Tensor, w2: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float stacked experts -> ``(w13, w13_scale_inv, w2, w2_scale_inv)`` in FP8, each
    projection by its own blocks (the bytes a load of the per-expert tensors writes)."""
    i = w2.shape[2]
    gate_q, gate_s = quantize_blocks(w13[:, :i])
    up_q, up_s = quantize_blocks(w13[:, i:])
    w2_q, w2_s = quantize_blocks(w2)
    return (torch.cat([gate_q.view(torch.uint8), up_q.view(torch.uint8)], dim=1).view(FP8_DTYPE),
            torch.cat([gate_s, up_s], dim=1), w2_q, w2_s)
