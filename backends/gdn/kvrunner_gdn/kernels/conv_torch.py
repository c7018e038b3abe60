"""Plain-torch paths of the causal conv (decode update and varlen prefill), and the
argument checks their Triton launchers share. No Triton import: the CPU path."""

from __future__ import annotations

import torch

from kvrunner_gdn.kernels.common import check_indices, valid_rows


def check_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2 or conv_state.dim() != 3:
        raise ValueError("expected x [B, D], weight [D, K], conv_state [N, D, K-1]")
    if conv_state.shape[1:] != (x.shape[1], weight.shape[1] - 1) or weight.shape[0] != x.shape[1]:
        raise ValueError(
            f"shape mismatch: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
            f"conv_state {tuple(conv_state.shape)}"
        )


def conv1d_update_torch(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    read_indices: torch.Tensor,
    write_indices: torch.Tensor,
    activation: bool = True,
) -> torch.Tensor:
    """Plain-torch path (CPU, and the fallback): same contract, not graph-capturable."""
    check_update(x, conv_state, weight)
    rows = x.shape[0]
    check_indices("read_indices", read_indices, rows)
    check_indices("write_indices", write_indices, rows)
    runs, reads = valid_rows(read_indices.long(), write_indices.long())
    history = torch.zeros(rows, *conv_state.shape[1:], dtype=torch.float32, device=x.device)
    history[reads] = conv_state[read_indices.long()[reads]].float()
    window = torch.cat([history, x.float()[:, :, None]], dim=2)
    acc = (window * weight.float()).sum(dim=2)
    if bias is not None:
        acc = acc + bias.float()
    if activation:
        acc = acc * torch.sigmoid(acc)
    acc[~runs] = 0.0
    conv_state[write_indices.long()[runs]] = window[runs, :, 1:].to(conv_state.dtype)
    return acc.to(x.dtype)


def check_prefill(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
           cu_seqlens: torch.Tensor, read: torch.Tensor, write: torch.Tensor) -> int:
    if x.dim() != 2 or weight.dim() != 2 or conv_state.dim() != 3 or cu_seqlens.dim() != 1:
        raise ValueError(
            "expected x [T, D], weight [D, K], conv_state [N, D, K-1], cu_seqlens [S+1]"
        )
    if conv_state.shape[1:] != (x.shape[1], weight.shape[1] - 1) or weight.shape[0] != x.shape[1]:
        raise ValueError(
            f"shape mismatch: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
            f"conv_state {tuple(conv_state.shape)}"
        )
    seqs = cu_seqlens.shape[0] - 1
    check_indices("read_indices", read, seqs)
    check_indices("write_indices", write, seqs)
    return seqs


def conv1d_prefill_torch(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    read_indices: torch.Tensor,
    write_indices: torch.Tensor,
    max_seqlen: int | None = None,
    activation: bool = True,
    *,
    total_tokens: int | None = None,
) -> torch.Tensor:
    """Plain-torch path: one ``conv1d`` per sequence (host loop), same contract.
    ``total_tokens`` (the launchers' hint that every row is written) changes nothing
    here: the output always starts from zeros."""
    seqs = check_prefill(x, conv_state, weight, cu_seqlens, read_indices, write_indices)
    width = weight.shape[1]
    out = torch.zeros_like(x)
    cu = cu_seqlens.tolist()
    runs, reads = valid_rows(read_indices.long().cpu(), write_indices.long().cpu())
    w = weight.float()[:, None, :]
    b = bias.float() if bias is not None else None
    # Gather every left context before any write, so a slot read by one sequence and
    # written by another in the same step is read as it was before the step.
    history = []
    for s in range(seqs):
        h = torch.zeros(x.shape[1], width - 1, dtype=torch.float32, device=x.device)
        if reads[s]:
            h = conv_state[int(read_indices[s])].float().clone()
        history.append(h)
    for s in range(seqs):
        if not runs[s]:
            continue
        full = torch.cat([history[s], x[cu[s] : cu[s + 1]].float().T], dim=1)
        y = torch.nn.functional.conv1d(full[None], w, b, groups=x.shape[1])[0].T
        if activation:
            y = y * torch.sigmoid(y)
        out[cu[s] : cu[s + 1]] = y.to(x.dtype)
        conv_state[int(write_indices[s])] = full[:, full.shape[1] - (width - 1) :]
    return out
