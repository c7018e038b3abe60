"""Mixture-of-experts layers: the fused experts and the sparse block around them.

:class:`FusedMoE` holds every expert's weights stacked in the layout the grouped
kernels read: ``w13`` ``[E, 2I, H]`` (each expert's gate rows, then its up rows) and
``w2`` ``[E, H, I]``. The checkpoint's per-expert tensors
(``experts.{e}.gate_proj.weight`` ...) load into their slices by name, so a whole
checkpoint and a partial ``update_weights`` take the same path. Built under
``quantization="fp8"`` the stacked weights are FP8 with 128 x 128 block scales
(``layers/fp8/experts.py``): a float tensor is quantized as it loads, an FP8
checkpoint's bytes and scales load as stored, and the grouped kernels dequantize
each weight tile by its scale as they stream it; the router stays in the model
dtype. Under tensor
parallelism each expert's intermediate dimension is split over ranks (``I / tp``
gate and up rows, the matching ``w2`` columns): every rank runs every expert on its
slice and the partial sums meet in the block's one all-reduce. The expert axis is
kept whole and first, so expert parallelism can later hold a subset of it.

:class:`SparseMoeBlock` is the router, the experts and (Qwen3-Next) a shared expert
scaled by a sigmoid gate, with one all-reduce for all of them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvrunner.layers.batch_invariant import INVARIANT_MOE_CONFIG
from kvrunner.layers.expert_routes import RouteRecorder
from kvrunner.layers.fp8.blocks import BLOCK, cdiv, is_fp8
from kvrunner.layers.fp8.choice import building_quantization
from kvrunner.layers.fp8.experts import (
    dequantize_experts,
    is_scale_target,
    load_expert_weight,
    make_fp8_expert_params,
    scale_piece,
)
from kvrunner.layers.fused.dispatch import batch_invariant, same_kernel_dtype, use_triton
from kvrunner.layers.linear import (
    SINGLE,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    TPGroup,
    divide,
    project,
)
from kvrunner.layers.moe_align import align_to_blocks
from kvrunner.layers.moe_experts import grouped_experts_torch
from kvrunner.layers.moe_routing import topk_softmax
from kvrunner.layers.weight_copy import copy_weight_
from kvrunner.plugin_api.step_data import ForwardContext

#: the checkpoint projection names, by the part of ``w13``/``w2`` they fill
PROJECTIONS = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


class FusedMoE(nn.Module):
    """Every expert's SwiGLU MLP, stacked; ``forward`` returns this rank's partial sum."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 dtype: torch.dtype, device: torch.device | str, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts
        self.i_local = divide(intermediate_size, tp.size, "moe_intermediate_size")
        #: the stacked weights are FP8 with block scales (``w13_scale_inv``, ``w2_scale_inv``)
        self.fp8 = building_quantization() == "fp8"
        if self.fp8:
            make_fp8_expert_params(self, num_experts, hidden_size, self.i_local, device)
        else:
            self.w13 = nn.Parameter(
                torch.empty(num_experts, 2 * self.i_local, hidden_size, dtype=dtype,
                            device=device),
                requires_grad=False,
            )
            self.w2 = nn.Parameter(
                torch.empty(num_experts, hidden_size, self.i_local, dtype=dtype, device=device),
                requires_grad=False,
            )
        # Checkpoint names relative to this module -> shard id (see models/weight_names.py).
        self.w13.checkpoint_shards = {
            f"{e}.{PROJECTIONS[part]}.weight": (part, e)
            for e in range(num_experts) for part in ("gate", "up")
        }
        self.w2.checkpoint_shards = {
            f"{e}.down_proj.weight": ("down", e) for e in range(num_experts)
        }
        # transformers 5 keeps the experts stacked in this very layout (``experts.gate_up_proj``
        # [E, 2I, H], ``experts.down_proj`` [E, H, I]); a trainer on it pushes those names.
        # A float stacked tensor loaded into FP8 experts writes their scales too.
        scales13 = list(self.w13_scale_inv.checkpoint_shards) if self.fp8 else []
        scales2 = list(self.w2_scale_inv.checkpoint_shards) if self.fp8 else []
        self.w13.checkpoint_aliases = {
            "gate_up_proj": (("gate_up", None), list(self.w13.checkpoint_shards) + scales13)
        }
        self.w2.checkpoint_aliases = {
            "down_proj": (("down", None), list(self.w2.checkpoint_shards) + scales2)
        }
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard: tuple[str, int | None] | Any = None) -> None:
        """Copy this rank's slice of one expert's full checkpoint projection, or of every
        expert's at once (``expert`` None: the stacked ``[E, ...]`` tensor). FP8 experts
        take the projection's ``weight_scale_inv`` here too, and quantize a float one."""
        part, expert = shard
        if expert is None:
            self._load_stacked(param, loaded, part)
            return
        i, r, size = self.i_local, self.tp.rank, self.tp.size
        hidden = self.w2.shape[1]
        name = f"expert {expert} {PROJECTIONS[part]}"
        weight, scale = self._fp8_pair(part)
        if scale is not None and is_scale_target(param, weight, scale):
            ib = cdiv(i, BLOCK)
            piece = scale_piece(loaded, part=part, rank=r, ib_local=ib, hidden=hidden,
                                tp_size=size, what=f"{name} weight_scale_inv")
            rows = slice(None) if part == "down" else (
                slice(0, ib) if part == "gate" else slice(ib, 2 * ib))
            copy_weight_(param[expert, rows], piece, what=f"{name} weight_scale_inv")
            return
        if part == "down":
            want, piece = (hidden, i * size), loaded[:, r * i : (r + 1) * i]
            target, scale_rows = param[expert], slice(None)
        else:
            want, piece = (i * size, hidden), loaded[r * i : (r + 1) * i]
            target = param[expert, (0 if part == "gate" else i) : (i if part == "gate" else 2 * i)]
            ib = cdiv(i, BLOCK)
            scale_rows = slice(0, ib) if part == "gate" else slice(ib, 2 * ib)
        if tuple(loaded.shape) != want:
            raise ValueError(f"{name}: expected shape {want}, got {tuple(loaded.shape)}")
        if not self.fp8:
            copy_weight_(target, piece)
            return
        # only the layer's own weight takes scales (a twin's loads write nothing beside it)
        scale_target = scale[expert, scale_rows] if param is weight else None
        load_expert_weight(target, scale_target, piece, what=name)

    def _fp8_pair(self, part: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stacked weight ``part`` lands in and its scales (None: not FP8)."""
        weight = self.w2 if part == "down" else self.w13
        if not self.fp8:
            return weight, None
        return weight, self.w2_scale_inv if part == "down" else self.w13_scale_inv

    def _load_stacked(self, param: nn.Parameter, loaded: torch.Tensor, part: str) -> None:
        full_i, hidden = self.i_local * self.tp.size, self.w2.shape[1]
        want = (self.num_experts, hidden, full_i) if part == "down" else (
            self.num_experts, 2 * full_i, hidden)
        if tuple(loaded.shape) != want:
            raise ValueError(f"stacked experts: expected shape {want}, got {tuple(loaded.shape)}")
        if self.fp8 and is_fp8(loaded):
            raise ValueError("stacked experts: an FP8 stacked tensor has no block scales "
                             "beside it; give each expert's projection "
                             "(experts.{e}.gate_proj.weight and its weight_scale_inv) or "
                             "a float stacked tensor (quantized as it loads)")
        for e in range(self.num_experts):
            if part == "down":
                self.weight_loader(param, loaded[e], ("down", e))
            else:
                self.weight_loader(param, loaded[e, :full_i], ("gate", e))
                self.weight_loader(param, loaded[e, full_i:], ("up", e))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` and the routing (``[T, top_k]``) -> ``[T, H]``, not yet all-reduced."""
        scales = (self.w13_scale_inv, self.w2_scale_inv) if self.fp8 else None
        weights_fit = same_kernel_dtype(x, topk_weights) and (
            self.fp8 or same_kernel_dtype(x, self.w13))
        if use_triton(x) and weights_fit:
            from kvrunner.layers.fused.moe_triton import (
                fp8_tiles,
                grouped_experts_triton,
                kernel_config,
            )

            # Deterministic mode: one tiling whatever the tokens per expert.
            config = (dict(INVARIANT_MOE_CONFIG) if batch_invariant()
                      else kernel_config(topk_ids.numel(), self.num_experts))
            if self.fp8:
                config = fp8_tiles(config, BLOCK)
            blocks = align_to_blocks(topk_ids, self.num_experts, config["BLOCK_M"])
            per_slot = grouped_experts_triton(x, self.w13, self.w2, topk_weights, blocks, config,
                                              scales=scales, scale_block=BLOCK)
        else:
            # The torch path multiplies the dequantized weights (the CPU path and the oracle).
            w13, w2 = (self.w13, self.w2) if scales is None else dequantize_experts(
                self.w13, scales[0], self.w2, scales[1], x.dtype)
            per_slot = grouped_experts_torch(x, w13, w2, topk_weights, topk_ids)
        return per_slot.sum(dim=1)


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP whose down projection leaves its partial sum unreduced."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype,
                 device: torch.device | str, tp: TPGroup) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device, tp=tp)
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, **kw)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, reduce_output=False,
                                           **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # SwiGLU; one row fuses the activation into the down projection's launch
        return self.down_proj.forward_silu_mul(self.gate_up_proj(x))


class SparseMoeBlock(nn.Module):
    """Router (``gate``), top-k experts, optional gated shared expert; one all-reduce.

    Module names follow the checkpoints (``mlp.gate``, ``mlp.experts.{e}.*``,
    ``mlp.shared_expert.*``, ``mlp.shared_expert_gate``). ``router_dtype`` (set by
    :func:`~kvrunner.layers.numerics.choose_numerics`) computes the router logits in
    that dtype (float32: ``fp32_router_logits``); ``None`` in the activations'.
    """

    router_dtype: torch.dtype | None = None

    def __init__(self, *, hidden_size: int, num_experts: int, top_k: int,
                 intermediate_size: int, renormalize: bool, shared_intermediate_size: int = 0,
                 dtype: torch.dtype, device: torch.device | str, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}")
        self.tp, self.top_k, self.renormalize = tp, top_k, renormalize
        kw = dict(dtype=dtype, device=device)
        # The router is replicated: every rank routes the same (identical) input alike.
        self.gate = ReplicatedLinear(hidden_size, num_experts, **kw)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, tp=tp, **kw)
        if shared_intermediate_size:
            self.shared_expert = SharedExpert(hidden_size, shared_intermediate_size, tp=tp, **kw)
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, **kw)
        else:
            self.shared_expert = self.shared_expert_gate = None
        #: records each token's expert ids at its KV slot, when the engine keeps them
        #: (``layers/expert_routes.py``); None: nothing is recorded
        self.routes: RouteRecorder | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights [T, k] x's dtype, topk_ids [T, k] int32)``."""
        if self.router_dtype is None:
            return topk_softmax(self.gate(x), self.top_k, self.renormalize)
        logits = project(x.to(self.router_dtype), self.gate.weight.to(self.router_dtype))
        weights, ids = topk_softmax(logits, self.top_k, self.renormalize)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        """``[T, H]`` -> ``[T, H]``; ``ctx``: the step's metadata, where routes are recorded."""
        weights, ids = self.route(x)
        if self.routes is not None and ctx is not None:
            self.routes.record(ids, ctx)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            # The gate is replicated, so scaling each rank's partial sum scales the total.
            out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.reduce(out)
