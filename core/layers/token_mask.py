"""A step's token masks on its logits: what a structured-output constraint forbids is -inf.

The engine packs each constrained row's allowed tokens into bits
(``engine/token_masks.py``, xgrammar's layout); here they go up in one pinned upload,
are unpacked on the device and every forbidden token of those rows is set to -inf, on
a copy (a decode graph's logits buffer is left as the graph wrote it). The sampler
applies it first, before any logit rule, so every pick and every reported logprob of a
constrained row sees the masked logits, as vLLM's sampler does. Rows without a mask are
copied unchanged.
"""

from __future__ import annotations

import torch

from kvrunner.engine.token_masks import TokenMasks, mask_width
from kvrunner.plugin_api.buffers import on_device

#: bit ``j`` of a 32-bit word, for unpacking a row's words on the device
_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def masked_logits(logits: torch.Tensor, masks: TokenMasks) -> torch.Tensor:
    """A copy of ``logits`` ``[N, V]`` whose masked rows hold -inf at every token their
    mask forbids.

    :raises ValueError: when the masks were packed for another vocabulary width.
    """
    n, vocab = logits.shape
    words = masks.bits.shape[1]
    if words != mask_width(vocab):
        raise ValueError(
            f"token masks of {words} words for logits of {vocab} tokens (need "
            f"{mask_width(vocab)}): the engine's vocabulary and the model's differ"
        )
    device = logits.device
    shifts = _BIT_SHIFTS.get(device)
    if shifts is None:
        shifts = _BIT_SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    rows = on_device(masks.rows, torch.int64, device)
    bits = on_device(masks.bits, torch.int32, device)
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().reshape(len(masks.rows), -1)
    out = logits.clone()
    out[rows] = out[rows].masked_fill(~allowed[:, :vocab], float("-inf"))
    return out
