"""The prefill conv in plain torch (no Triton import: the CPU path): one ``conv1d`` per
sequence (a host loop), the contract of :mod:`.prefill`."""

from __future__ import annotations

import torch

from kvrunner_gdn.ops.short_conv.inputs import ShortConvInputs
from kvrunner_gdn.ops.utils import valid_rows


def short_conv_prefill_torch(*, inputs: ShortConvInputs) -> torch.Tensor:
    """Concatenated sequences: ``[T, D]`` in x's dtype (rows past the last sequence zero);
    the pool updated in place. ``total_tokens`` changes nothing here: the output always
    starts from zeros."""
    c = inputs
    seqs = c.sequences(varlen=True)
    assert c.cu_seqlens is not None  # checked by sequences
    x, state = c.x, c.conv_state
    width = c.weight.shape[1]
    out = torch.zeros_like(x)
    cu = c.cu_seqlens.tolist()
    runs, reads = valid_rows(c.read_indices.long().cpu(), c.write_indices.long().cpu())
    w = c.weight.float()[:, None, :]
    b = c.bias.float() if c.bias is not None else None
    # Gather every left context before any write, so a slot read by one sequence and
    # written by another in the same step is read as it was before the step.
    history = []
    for s in range(seqs):
        h = torch.zeros(x.shape[1], width - 1, dtype=torch.float32, device=x.device)
        if reads[s]:
            h = state[int(c.read_indices[s])].float().clone()
        history.append(h)
    for s in range(seqs):
        if not runs[s]:
            continue
        full = torch.cat([history[s], x[cu[s] : cu[s + 1]].float().T], dim=1)
        y = torch.nn.functional.conv1d(full[None], w, b, groups=x.shape[1])[0].T
        if c.activation:
            y = y * torch.sigmoid(y)
        out[cu[s] : cu[s + 1]] = y.to(x.dtype)
        state[int(c.write_indices[s])] = full[:, full.shape[1] - (width - 1) :]
    return out
