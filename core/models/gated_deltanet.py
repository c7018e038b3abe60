"""Qwen3-Next's Gated-DeltaNet mixer: its projections and weights; the conv and the
delta-rule recurrence are the backend's (``gdn``), handed the step's context.

Also its gated RMSNorm (the output norm, gated by ``z``). The rest of the model is in
:mod:`kvrunner.models.qwen3_next`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvrunner.layers.linear import ColumnParallelLinear, RowParallelLinear, TPGroup, divide
from kvrunner.layers.weight_copy import copy_weight_
from kvrunner.models.qwen3_next_config import Qwen3NextConfig
from kvrunner.plugin_api.step_data import ForwardContext


class GatedRMSNorm(nn.Module):
    """``weight * norm(x) * silu(z)`` per value head (norm before gate)."""

    def __init__(
        self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(x.dtype) * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Projections, decay and gates, gated norm and output; conv + recurrence in the backend."""

    def __init__(
        self,
        c: Qwen3NextConfig,
        impl: Any,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TPGroup,
    ) -> None:
        super().__init__()
        hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
        self.kd, self.vd = c.linear_key_head_dim, c.linear_value_head_dim
        self.ratio = hv // hk
        self.tp = tp
        # Heads split over ranks by key head: a key head and its value heads stay together.
        self.hk = divide(hk, tp.size, "GDN key heads")
        self.hv = self.hk * self.ratio
        kw = dict(dtype=dtype, device=device, tp=tp)
        # The checkpoint groups in_proj_qkvz / in_proj_ba rows by key head, so a
        # contiguous row shard is exactly this rank's key heads.
        self.in_proj_qkvz = ColumnParallelLinear(
            c.hidden_size, 2 * hk * self.kd + 2 * hv * self.vd, **kw
        )
        self.in_proj_ba = ColumnParallelLinear(c.hidden_size, 2 * hv, **kw)
        conv_dim = 2 * self.hk * self.kd + self.hv * self.vd
        self.conv_weight = nn.Parameter(
            torch.empty(conv_dim, c.linear_conv_kernel_dim, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.conv_weight.weight_loader = self._load_conv_weight
        self.dt_bias = nn.Parameter(
            torch.ones(self.hv, dtype=dtype, device=device), requires_grad=False
        )
        self.A_log = nn.Parameter(
            torch.zeros(self.hv, dtype=dtype, device=device), requires_grad=False
        )
        for per_value_head in (self.dt_bias, self.A_log):
            per_value_head.weight_loader = self._load_value_head_slice
        self.norm = GatedRMSNorm(self.vd, c.rms_norm_eps, dtype=dtype, device=device)
        self.out_proj = RowParallelLinear(hv * self.vd, c.hidden_size, **kw)
        object.__setattr__(self, "impl", impl)  # backend-owned; not a weight

    def _load_conv_weight(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: Any = None
    ) -> None:
        """The conv's channels are ``[q all heads | k all heads | v all heads]``: take
        this rank's heads from each of the three sections."""
        r, size = self.tp.rank, self.tp.size
        q_all, v_all = self.hk * size * self.kd, self.hv * size * self.vd
        if loaded.shape != (2 * q_all + v_all, param.shape[1]):
            raise ValueError(
                f"conv weight: expected {(2 * q_all + v_all, param.shape[1])}, "
                f"got {tuple(loaded.shape)}"
            )
        q_n, v_n = self.hk * self.kd, self.hv * self.vd
        parts = [
            loaded[r * q_n : (r + 1) * q_n],
            loaded[q_all + r * q_n : q_all + (r + 1) * q_n],
            loaded[2 * q_all + r * v_n : 2 * q_all + (r + 1) * v_n],
        ]
        copy_weight_(param, torch.cat(parts))

    def _load_value_head_slice(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: Any = None
    ) -> None:
        if loaded.shape != (self.hv * self.tp.size,):
            raise ValueError(
                f"per-value-head tensor: expected {(self.hv * self.tp.size,)}, "
                f"got {tuple(loaded.shape)}"
            )
        copy_weight_(param, loaded[self.tp.rank * self.hv : (self.tp.rank + 1) * self.hv])

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        # Checkpoint layout groups everything by key head: [q | k | v-group | z-group].
        qkvz = self.in_proj_qkvz(x).view(t, self.hk, -1)
        q, k, v, z = qkvz.split(
            [self.kd, self.kd, self.ratio * self.vd, self.ratio * self.vd], dim=-1
        )
        b, a = self.in_proj_ba(x).view(t, self.hk, -1).split([self.ratio, self.ratio], dim=-1)
        mixed_qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        g = -self.A_log.float().exp() * F.softplus(
            a.reshape(t, self.hv).float() + self.dt_bias.float()
        )
        beta = b.reshape(t, self.hv).sigmoid()
        out = self.impl.forward(mixed_qkv, g, beta, self.conv_weight, None, ctx)
        out = self.norm(out.reshape(-1, self.vd), z.reshape(-1, self.vd))
        return self.out_proj(out.reshape(t, self.hv * self.vd))
