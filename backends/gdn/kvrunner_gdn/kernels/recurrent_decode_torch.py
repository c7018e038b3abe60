"""Plain-torch path of the decode recurrence (no Triton import: the CPU path)."""

from __future__ import annotations

import torch

from kvrunner_gdn.kernels.common import check_heads, check_indices, valid_rows
from kvrunner_gdn.kernels.reference import l2norm


def gdn_decode_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    read_indices: torch.Tensor,
    write_indices: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Plain-torch path: vectorised over rows and heads; same contract, not graph-capturable."""
    check_heads(q, k, v, g, beta, state)
    rows, num_k_heads, _ = k.shape
    group = v.shape[1] // num_k_heads
    check_indices("read_indices", read_indices, rows)
    check_indices("write_indices", write_indices, rows)
    runs, reads = valid_rows(read_indices.long(), write_indices.long())
    qf, kf = q.float(), k.float()
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    qf = (qf * scale).repeat_interleave(group, dim=1)
    kf = kf.repeat_interleave(group, dim=1)
    s = torch.zeros(rows, *state.shape[1:], dtype=torch.float32, device=state.device)
    s[reads] = state[read_indices.long()[reads]]
    s = s * torch.exp(g.float())[:, :, None, None]
    kv_mem = torch.einsum("bhkv,bhk->bhv", s, kf)
    delta = beta.float()[:, :, None] * (v.float() - kv_mem)
    s = s + kf[:, :, :, None] * delta[:, :, None, :]
    out = torch.einsum("bhkv,bhk->bhv", s, qf)
    out[~runs] = 0.0
    state[write_indices.long()[runs]] = s[runs]
    return out.to(v.dtype)
