"""The naive fp32 gated delta rule: one sequence, one token at a time, no pool, no tricks.

The definition every gated-delta-rule entry is tested against. It takes an explicit
initial state (``None`` = zeros) and returns the final one, so a test decides what the
pool around it should look like. It follows Hugging Face's ``Qwen3NextGatedDeltaNet``
(transformers ``models/qwen3_next``):

- q/k L2-normalised (``x * rsqrt(sum(x^2) + 1e-6)``), q scaled by ``1/sqrt(head_k_dim)``;
- value head ``h`` uses key head ``h // (Hv // Hk)``;
- per token: ``S *= exp(g)``; ``delta = beta * (v - S^T k)``; ``S += k delta^T``;
  ``o = S^T q`` with ``S`` of shape ``[head_k_dim, head_v_dim]``.
"""

from __future__ import annotations

import torch

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """Normalise the last dimension the way the model was trained (eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def naive_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence, token by token, in fp32.

    :param q: ``[L, Hk, K]``; :param k: ``[L, Hk, K]``; :param v: ``[L, Hv, V]``.
    :param g: ``[L, Hv]`` log-decay; :param beta: ``[L, Hv]`` write strength.
    :param initial_state: ``[Hv, K, V]`` or ``None`` (zeros).
    :param scale: query scale; ``None`` means ``K ** -0.5``.
    :returns: ``(out [L, Hv, V] float32, final_state [Hv, K, V] float32)``.
    """
    length, num_k_heads, head_k = k.shape
    num_v_heads, head_v = v.shape[1], v.shape[2]
    group = num_v_heads // num_k_heads
    scale = head_k**-0.5 if scale is None else scale
    qf, kf = q.float(), k.float()
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    qf = qf * scale
    state = torch.zeros(num_v_heads, head_k, head_v, dtype=torch.float32)
    if initial_state is not None:
        state = initial_state.float().clone()
    out = torch.zeros(length, num_v_heads, head_v, dtype=torch.float32)
    for t in range(length):
        for h in range(num_v_heads):
            kh, qh = kf[t, h // group], qf[t, h // group]
            s = state[h] * torch.exp(g[t, h].float())
            delta = beta[t, h].float() * (v[t, h].float() - s.T @ kh)
            s = s + torch.outer(kh, delta)
            state[h] = s
            out[t, h] = s.T @ qh
    return out, state
