"""Naive fp32 references the checks compare a backend with: one sequence at a time,
its whole history recomputed, no cache and no tricks."""

from __future__ import annotations

import torch

#: the epsilon of the q/k L2 norm, inside the root (as the model was trained)
L2NORM_EPS = 1e-6


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` as an FP8 KV cache at scale 1.0 holds it: clamped to ±448, rounded to
    float8 e4m3 (ties to even), back in float32."""
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()


def full_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: range
) -> torch.Tensor:
    """Causal softmax attention of the queries at ``positions`` over keys ``0 .. p``.

    :param q: ``[len(positions), num_heads, head_dim]``.
    :param k: ``[history, num_kv_heads, head_dim]``, every position of the sequence
        up to the last query (``history >= positions.stop``); ``v`` likewise.
    :returns: ``[len(positions), num_heads, head_dim]`` fp32; scale ``head_dim ** -0.5``;
        query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
    """
    group = q.shape[1] // k.shape[1]
    keys = k.double().repeat_interleave(group, dim=1)
    values = v.double().repeat_interleave(group, dim=1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for row, p in enumerate(positions):
        scores = torch.einsum("hd,khd->hk", q[row].double(), keys[: p + 1]) * q.shape[-1] ** -0.5
        out[row] = torch.einsum("hk,khd->hd", scores.softmax(dim=-1), values[: p + 1])
    return out.float()


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def gated_delta_rule(
    mixed_qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    *,
    num_key_heads: int,
    head_k_dim: int,
    num_value_heads: int,
    head_v_dim: int,
) -> torch.Tensor:
    """A linear-attention layer over one whole sequence from an empty state.

    Causal depthwise conv (window: the ``kernel - 1`` previous inputs and the current
    one, zeros before the start) with SiLU; split into q, k, v; q and k L2-normalised,
    q scaled by ``head_k_dim ** -0.5``; then per token and value head ``h`` (key head
    ``h // (Hv // Hk)``): ``S *= exp(g)``; ``S += k (beta (v - S^T k))^T``; ``o = S^T q``.

    :param mixed_qkv: ``[L, conv_dim]``; ``g``, ``beta``: ``[L, Hv]``.
    :returns: ``[L, Hv, head_v_dim]`` fp32.
    """
    length, dim = mixed_qkv.shape
    width = conv_weight.shape[1]
    padded = torch.cat([torch.zeros(width - 1, dim, dtype=torch.float64), mixed_qkv.double()])
    x = torch.stack(
        [(padded[t : t + width].T * conv_weight.double()).sum(dim=1) for t in range(length)]
    )
    if conv_bias is not None:
        x = x + conv_bias.double()
    x = x * torch.sigmoid(x)
    key_dim = num_key_heads * head_k_dim
    q = _l2norm(x[:, :key_dim].unflatten(1, (num_key_heads, head_k_dim))) * head_k_dim**-0.5
    k = _l2norm(x[:, key_dim : 2 * key_dim].unflatten(1, (num_key_heads, head_k_dim)))
    v = x[:, 2 * key_dim :].unflatten(1, (num_value_heads, head_v_dim))
    group = num_value_heads // num_key_heads
    out = torch.zeros(length, num_value_heads, head_v_dim, dtype=torch.float64)
    for h in range(num_value_heads):
        kh = h // group
        state = torch.zeros(head_k_dim, head_v_dim, dtype=torch.float64)
        for t in range(length):
            state = state * torch.exp(g[t, h].double())
            delta = beta[t, h].double() * (v[t, h] - state.T @ k[t, kh])
            state = state + torch.outer(k[t, kh], delta)
            out[t, h] = state.T @ q[t, kh]
    return out.float()
