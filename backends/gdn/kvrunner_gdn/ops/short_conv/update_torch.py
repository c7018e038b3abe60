"""The decode conv in plain torch (no Triton import: the CPU path): the contract of
:mod:`.update`, not graph-capturable (it masks on the host)."""

from __future__ import annotations

import torch

from kvrunner_gdn.ops.short_conv.inputs import ShortConvInputs
from kvrunner_gdn.ops.utils import valid_rows


def short_conv_update_torch(*, inputs: ShortConvInputs) -> torch.Tensor:
    """One new token per sequence: ``[B, D]`` in x's dtype; the pool updated in place."""
    c = inputs
    rows = c.sequences(varlen=False)
    read, write = c.read_indices.long(), c.write_indices.long()
    runs, reads = valid_rows(read, write)
    history = torch.zeros(rows, *c.conv_state.shape[1:], dtype=torch.float32, device=c.x.device)
    history[reads] = c.conv_state[read[reads]].float()
    window = torch.cat([history, c.x.float()[:, :, None]], dim=2)
    acc = (window * c.weight.float()).sum(dim=2)
    if c.bias is not None:
        acc = acc + c.bias.float()
    if c.activation:
        acc = acc * torch.sigmoid(acc)
    acc[~runs] = 0.0
    c.conv_state[write[runs]] = window[runs, :, 1:].to(c.conv_state.dtype)
    return acc.to(c.x.dtype)
