"""A linear layer's FP8 storage and how a full tensor loads into it.

An FP8 linear holds ``weight`` (``float8_e4m3fn``, ``[out_local, in_local]``) and
``weight_scale_inv`` (float32, one per 128 x 128 block: :func:`~.blocks.scale_shape`),
both parameters, so sleep, wake, residency and the IPC receivers treat them as any
weight. A load places one *part* of a full checkpoint tensor: rows ``[index * size,
+ size)`` of a tensor ``total`` wide along ``dim`` (0: the layer's output rows at
``offset``; 1: its input columns), as the layer's bf16 loader does. What arrives
decides what happens:

* a float tensor for ``weight`` (a trainer's bf16, a bf16 checkpoint): the part is
  quantized by its own blocks and both the bytes and the scales are written;
* an FP8 tensor for ``weight`` (an FP8 checkpoint or push): its bytes are placed as
  they are, and its ``weight_scale_inv`` arrives under its own name and is placed by
  blocks;
* an integer tensor (the checksum's position probe): placed as the values would be.

Quantizing a part equals quantizing the full tensor and taking the part only when
the part starts on a block boundary, so every part of a fused layer (q, k, v; gate,
up) and every tensor-parallel shard must start on one: :func:`check_part_alignment`
refuses a layer whose parts do not, when it is built.
"""

from __future__ import annotations

import torch
from torch import nn

from kvrunner.errors import ConfigError
from kvrunner.layers.fp8.blocks import (
    BLOCK,
    FP8_DTYPE,
    cdiv,
    is_fp8,
    quantize_blocks,
    scale_shape,
)
from kvrunner.layers.weight_copy import copy_weight_

#: the checkpoint suffix of a weight's block scales, beside ``weight``
SCALE_SUFFIX = "weight_scale_inv"


def make_fp8_params(layer: nn.Module, out_local: int, in_local: int,
                    device: torch.device | str) -> None:
    """Give ``layer`` an FP8 ``weight`` and its ``weight_scale_inv``, both loaded through
    ``layer.weight_loader``. The weight carries ``fp8_scale_name`` so a float tensor
    loaded into it counts for its scales too (``models/weight_names.py``)."""
    layer.weight = nn.Parameter(
        torch.empty(out_local, in_local, dtype=FP8_DTYPE, device=device), requires_grad=False)
    layer.weight_scale_inv = nn.Parameter(
        torch.ones(scale_shape((out_local, in_local)), dtype=torch.float32, device=device),
        requires_grad=False)
    layer.weight.weight_loader = layer.weight_scale_inv.weight_loader = layer.weight_loader
    layer.weight.fp8_scale_name = SCALE_SUFFIX


def check_part_alignment(what: str, starts: list[int]) -> None:
    """Refuse parts (local row offsets, or shard starts in the full tensor) that do not
    start on a block boundary: their blocks would not be the checkpoint's."""
    bad = [s for s in starts if s % BLOCK]
    if bad:
        raise ConfigError(
            f"{what}: quantization='fp8' needs every fused part and tensor-parallel shard "
            f"to start on a multiple of {BLOCK} rows or columns (its scale blocks are "
            f"{BLOCK} x {BLOCK}); parts start at {starts}")


def load_fp8_part(weight: nn.Parameter, scale: nn.Parameter, param: torch.Tensor,
                  loaded: torch.Tensor, *, dim: int, index: int, size: int, total: int,
                  offset: int, what: str) -> None:
    """Place one part of the full tensor ``loaded`` into ``param``, which is the layer's
    ``weight`` or ``weight_scale_inv`` (or a twin of either: a meta one for a dry run,
    an integer one for the checksum), as the module docstring says.

    :param weight: the layer's FP8 weight; :param scale: its scales (found beside a
        float tensor loaded into ``weight``).
    """
    if tuple(param.shape) == tuple(scale.shape) and param.dim() == 2 and (
            tuple(scale.shape) != tuple(weight.shape)):
        _place_blocks(param, loaded, dim=dim, index=index, size=size, total=total,
                      offset=offset, what=f"{what} {SCALE_SUFFIX}")
        return
    part = _part(loaded, dim, index, size, total, what)
    target = _target(param, dim, offset, size)
    if param.is_floating_point() and not is_fp8(loaded):
        if tuple(target.shape) != tuple(part.shape):
            raise ValueError(f"{what}: expected shape {tuple(target.shape)}, "
                             f"got {tuple(part.shape)}")
        if not param.is_meta:  # a meta twin is a dry run: shapes only
            quantize_blocks_into(part.to(param.device), target,
                                 _target(scale, dim, offset // BLOCK, cdiv(size, BLOCK)))
        return
    copy_weight_(target, part, what=what)


def quantize_blocks_into(w: torch.Tensor, q_out: torch.Tensor,
                         scale_out: torch.Tensor) -> None:
    """Quantize the matrix ``w`` into ``q_out`` (e4m3, ``w``'s shape) and ``scale_out``
    (float32, :func:`scale_shape`), views of a layer's parameters: the values of
    :func:`quantize_blocks`. On CUDA one Triton launch reads ``w`` once and writes the
    bytes and scales in place (``layers/fp8/block_quant_triton.py``); elsewhere the
    torch path runs and its result is copied in."""
    if w.dim() != 2 or tuple(q_out.shape) != tuple(w.shape) or (
            tuple(scale_out.shape) != scale_shape(w.shape)):
        raise ValueError(f"block quantization of a {tuple(w.shape)} matrix into "
                         f"{tuple(q_out.shape)} bytes and {tuple(scale_out.shape)} scales")
    if w.is_cuda and q_out.is_cuda and scale_out.is_cuda:
        # imported here: the CPU path runs without Triton installed
        from kvrunner.layers.fp8.block_quant_triton import quantize_blocks_triton

        quantize_blocks_triton(w, q_out, scale_out)
        return
    q, s = quantize_blocks(w)
    q_out.copy_(q)
    scale_out.copy_(s)


def _part(loaded: torch.Tensor, dim: int, index: int, size: int, total: int,
          what: str) -> torch.Tensor:
    if loaded.dim() != 2 or loaded.shape[dim] != total:
        raise ValueError(f"{what}: expected {total} along dim {dim} of a matrix, got shape "
                         f"{tuple(loaded.shape)}")
    return loaded.narrow(dim, index * size, size)


def _target(param: torch.Tensor, dim: int, offset: int, size: int) -> torch.Tensor:
    """The rows a part fills (dim 0), or the whole parameter (dim 1: a column shard)."""
    return param.narrow(0, offset, size) if dim == 0 else param


def _place_blocks(param: torch.Tensor, loaded: torch.Tensor, *, dim: int, index: int,
                  size: int, total: int, offset: int, what: str) -> None:
    """The scales of one part: the same part, counted in blocks."""
    full = list(param.shape)
    full[dim] = cdiv(total, BLOCK)
    if tuple(loaded.shape) != tuple(full):
        raise ValueError(f"{what}: expected shape {tuple(full)}, got {tuple(loaded.shape)}")
    blocks = cdiv(size, BLOCK)
    part = loaded.narrow(dim, index * size // BLOCK, blocks)
    copy_weight_(_target(param, dim, offset // BLOCK, blocks), part, what=what)
