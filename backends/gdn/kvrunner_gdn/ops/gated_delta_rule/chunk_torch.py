"""The chunked prefill in plain torch (no Triton import: the CPU path): same math, same
contract as :mod:`.chunk`, where the formulation is. Sequences are
handled one at a time (host loop); inside a sequence all heads and chunks are batched
matrix products, with one ``solve_triangular`` for the UT transform.
"""

from __future__ import annotations

import torch

from kvrunner_gdn.ops.gated_delta_rule.inputs import GatedDeltaRuleInputs
from kvrunner_gdn.ops.utils import valid_rows


def _chunk_one_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    s: torch.Tensor, chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, all heads at once. q/k (normalised, scaled, repeated) ``[L, H, K]``,
    v ``[L, H, V]``, g/beta ``[L, H]``, s ``[H, K, V]``; returns (out [L, H, V], state)."""
    length = q.shape[0]
    pad = (-length) % chunk

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [L, H, ...] -> [H, n, chunk, ...]
        x = torch.nn.functional.pad(x.movedim(0, -1), (0, pad)).movedim(-1, 0)
        return x.reshape(-1, chunk, *x.shape[1:]).movedim(2, 0)

    qb, kb, vb, gb, bb = (blocks(x) for x in (q, k, v, g, beta))
    gcum = gb.cumsum(dim=-1)
    diff = gcum[..., :, None] - gcum[..., None, :]
    ones = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device)
    strict, causal = ones.tril(-1), ones.tril(0)
    k_beta = kb * bb[..., None]
    a = (k_beta @ kb.transpose(-1, -2)) * diff.masked_fill(~strict, float("-inf")).exp()
    # unitriangular=True reads only the strict lower part of I + A, i.e. A itself.
    u = torch.linalg.solve_triangular(a, vb * bb[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        a, k_beta * gcum.exp()[..., None], upper=False, unitriangular=True
    )
    att = (qb @ kb.transpose(-1, -2)) * diff.masked_fill(~causal, float("-inf")).exp()
    q_decayed = qb * gcum.exp()[..., None]
    k_tail = kb * (gcum[..., -1:] - gcum).exp()[..., None]
    chunk_decay = gcum[..., -1].exp()
    out = torch.empty_like(vb)
    for c in range(qb.shape[1]):
        v_new = u[:, c] - w[:, c] @ s
        out[:, c] = q_decayed[:, c] @ s + att[:, c] @ v_new
        s = s * chunk_decay[:, c, None, None] + k_tail[:, c].transpose(-1, -2) @ v_new
    heads, head_v = vb.shape[0], vb.shape[-1]
    return out.movedim(0, 2).reshape(-1, heads, head_v)[:length], s


def chunk_gated_delta_rule_torch(*, inputs: GatedDeltaRuleInputs) -> torch.Tensor:
    """Concatenated sequences, one at a time (a host loop): ``[T, Hv, V]`` in v's dtype;
    the pool updated in place."""
    x = inputs
    seqs = x.sequences(chunked=True)
    assert x.cu_seqlens is not None  # checked by sequences
    state, v = x.state, x.v
    out = torch.zeros(v.shape[0], *v.shape[1:], dtype=v.dtype, device=v.device)
    runs, reads = valid_rows(x.read_indices.long().cpu(), x.write_indices.long().cpu())
    qf, kf = x.value_head_qk()
    cu = x.cu_seqlens.tolist()
    # Read every initial state before writing any (same semantics as the kernels).
    initial = [
        state[int(x.read_indices[i])].clone() if reads[i] else torch.zeros_like(state[0])
        for i in range(seqs)
    ]
    finals = {}
    for i in range(seqs):
        if not runs[i]:
            continue
        lo, hi = cu[i], cu[i + 1]
        o, finals[i] = _chunk_one_sequence(
            qf[lo:hi], kf[lo:hi], v[lo:hi].float(), x.g[lo:hi].float(), x.beta[lo:hi].float(),
            initial[i], x.chunk_size,
        )
        out[lo:hi] = o.to(out.dtype)
    for i, s in finals.items():
        state[int(x.write_indices[i])] = s
    return out
