"""The naive causal depthwise conv: one sequence, token by token, no pool, no tricks.

The definition every short-conv entry is tested against, as Hugging Face's
``Qwen3NextGatedDeltaNet`` runs its conv (transformers ``models/qwen3_next``): the
window is the previous ``kernel - 1`` inputs plus the current one, then SiLU. It
takes an explicit initial state (``None`` = zeros) and returns the final one.
"""

from __future__ import annotations

import torch


def naive_short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    activation: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over one sequence, token by token.

    :param x: ``[L, D]`` inputs.
    :param weight: ``[D, K]``; tap ``K - 1`` multiplies the current token.
    :param bias: ``[D]`` or ``None``.
    :param initial_state: ``[D, K - 1]`` previous inputs (oldest first) or ``None``.
    :returns: ``(out [L, D] float32, final_state [D, K - 1] float32)``.
    """
    length, dim = x.shape
    width = weight.shape[1]
    # The window holds the last `width` inputs; before the first token its newest
    # `width - 1` columns are the history, and each step shifts one column out.
    window = torch.zeros(dim, width, dtype=torch.float32)
    if initial_state is not None:
        window[:, 1:] = initial_state.float()
    w = weight.float()
    out = torch.zeros(length, dim, dtype=torch.float32)
    for t in range(length):
        window = torch.cat([window[:, 1:], x[t].float()[:, None]], dim=1)
        acc = (window * w).sum(dim=1)
        if bias is not None:
            acc = acc + bias.float()
        out[t] = acc * torch.sigmoid(acc) if activation else acc
    return out, window[:, 1:].clone()
