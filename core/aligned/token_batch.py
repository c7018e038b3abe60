"""The trainer's padded ``[B, S]`` batch as the engine's flat token batch, and back.

The engine computes sequences laid end to end, each numbered from position 0, with
no padding anywhere. A trainer's batch is padded (on the left or the right); its
real tokens become that flat batch, so padding never reaches a computation and
cannot change a bit of a real token, and the results are put back in the padded
layout with zeros at the pads.
"""

from __future__ import annotations

import attrs
import torch

from kvrunner.aligned.rules import AlignmentError


@attrs.frozen(kw_only=True)
class TokenBatch:
    """The real tokens of a padded batch, flat."""

    input_ids: torch.Tensor  #: ``[T]`` the real tokens, row by row
    positions: torch.Tensor  #: ``[T]`` each token's position in its sequence (from 0)
    lengths: list[int]  #: each row's real tokens, rows with none left out
    keep: torch.Tensor  #: ``[T]`` each token's index in the flattened ``[B * S]`` batch
    shape: tuple[int, int]  #: ``(B, S)``

    def unflatten(self, flat: torch.Tensor) -> torch.Tensor:
        """``[T, ...]`` -> ``[B, S, ...]`` with zeros at the pads (differentiable)."""
        rows, width = self.shape
        out = flat.new_zeros(rows * width, *flat.shape[1:])
        return out.index_copy(0, self.keep, flat).view(rows, width, *flat.shape[1:])


def token_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None) -> TokenBatch:
    """Flatten ``input_ids`` ``[B, S]`` by ``attention_mask`` (1: a real token; None:
    all real). Each row's real tokens must be one run (left or right padding);
    ``position_ids``, where given, must number them 0, 1, ... as the engine does."""
    if input_ids.dim() != 2:
        raise AlignmentError(f"aligned forward: input_ids must be [batch, tokens], got "
                             f"shape {tuple(input_ids.shape)}")
    mask = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
            else attention_mask.to(torch.bool))
    if mask.shape != input_ids.shape:
        raise AlignmentError(f"aligned forward: attention_mask {tuple(mask.shape)} must be the "
                             f"shape of input_ids {tuple(input_ids.shape)} (a 2-D padding mask)")
    counts = mask.sum(dim=1)
    first = mask.int().argmax(dim=1)
    column = torch.arange(mask.shape[1], device=mask.device)[None, :]
    run = (column >= first[:, None]) & (column < (first + counts)[:, None])
    if not torch.equal(run, mask):
        raise AlignmentError("aligned forward: each row's real tokens must be one run (left "
                             "or right padding); packed or holed rows are not supported")
    positions = (column - first[:, None]).expand_as(mask)
    if position_ids is not None:
        given = position_ids.expand_as(mask)
        if not torch.equal(given[mask], positions[mask]):
            raise AlignmentError("aligned forward: position_ids must number each row's real "
                                 "tokens 0, 1, ... (the engine's positions)")
    keep = mask.reshape(-1).nonzero().squeeze(1)
    lengths = [n for n in counts.tolist() if n]
    if not lengths:
        raise AlignmentError("aligned forward: the batch has no real tokens")
    return TokenBatch(input_ids=input_ids.reshape(-1)[keep], positions=positions.reshape(-1)[keep],
                      lengths=lengths, keep=keep, shape=(mask.shape[0], mask.shape[1]))
