"""Token embedding and LM head, split over tensor-parallel ranks by vocabulary rows.

Rank ``r`` holds rows ``[r * per_rank, (r + 1) * per_rank)`` of the (padded)
vocabulary. The vocabulary is padded up to a multiple of the group size; padded
rows are zero and padded logit columns are cut off, so callers always see exactly
``vocab_size`` columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvrunner.layers.linear import SINGLE, TPGroup, project
from kvrunner.layers.weight_copy import copy_weight_


class VocabEmbedding(nn.Module):
    """``input_ids [T] -> [T, hidden]``; with ``tp.size > 1`` each rank looks up the ids
    it owns, zeroes the rest and the ranks' results are summed."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.per_rank
        # zeros, not empty: padded rows are never loaded and must contribute nothing.
        self.weight = nn.Parameter(
            torch.zeros(self.per_rank, hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        """Copy this rank's rows of the full ``[vocab_size, hidden]`` checkpoint tensor."""
        if loaded.shape != (self.vocab_size, param.shape[1]):
            raise ValueError(
                f"{type(self).__name__}: expected shape {(self.vocab_size, param.shape[1])}, "
                f"got {tuple(loaded.shape)}"
            )
        rows = loaded[self.start : self.start + self.per_rank]
        copy_weight_(param[: rows.shape[0]], rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        owned = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight)
        return self.tp.reduce(out * owned.unsqueeze(-1).to(out.dtype))


class LMHead(VocabEmbedding):
    """``hidden [N, H] -> logits [N, vocab_size]`` in float32 (or, ``widen=False``, in
    the model dtype, for a reader that widens only what it needs, as the sampler does).

    ``tied_to`` shares the embedding's weight (``tie_word_embeddings``): the same
    Parameter object, so it is loaded once and stored once. ``compute_dtype`` (set by
    :func:`~kvrunner.layers.numerics.choose_numerics`) runs the product in that dtype
    (float32: ``fp32_lm_head``); ``None`` runs it in the weight's.
    """

    compute_dtype: torch.dtype | None = None

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TPGroup = SINGLE,
        tied_to: VocabEmbedding | None = None,
    ) -> None:
        super().__init__(vocab_size, hidden_size, dtype=dtype, device=device, tp=tp)
        if tied_to is not None:
            self.weight = tied_to.weight

    def forward(self, hidden: torch.Tensor, *, widen: bool = True) -> torch.Tensor:
        # The matmul runs in the model dtype (full speed; one row takes the skinny
        # GEMV, as the projections do); widened to float32, softmax, sampling and
        # logprobs see no bf16 rounding of their own. A decode step's sampler takes
        # the unwidened logits: a float32 copy of [N, vocab] is 4 bytes a logit
        # written and read again (about 0.2 ms at 1,024 rows of a 152k vocabulary on
        # an H200), and the widening is exact wherever the sampler does it.
        if self.compute_dtype is not None:
            hidden, weight = hidden.to(self.compute_dtype), self.weight.to(self.compute_dtype)
        else:
            weight = self.weight
        logits = self.tp.gather(project(hidden, weight))[..., : self.vocab_size]
        return logits.float() if widen else logits
