"""Non-finite logits rows: found from each row's maximum, on the device, every step.

The sampler already reduces every row to its maximum (a greedy row's token comes
from it, and a decode graph that ends with the tokens leaves it beside them), so
finding the rows that must not be sampled costs a few elementwise launches over
``[rows]`` and no host sync. A row counts as non-finite when its maximum is not
finite: it holds a NaN (NaN propagates through the max), it holds +inf, or every
logit is -inf (nothing can be drawn). A -inf logit among finite ones is a mask (a
filtered or impossible token) and is fine.

The host learns which rows they are with the tokens themselves: such a row's token is
replaced by the cause's code (:data:`~kvrunner.engine.step_io.NONFINITE_CAUSES`) in the copy
the host reads, while the device keeps the drawn token for the next step's
placeholder feed (that request ends, so what it feeds is never used).

Two forms, one rule: :func:`mark_nonfinite` after the sampler (eager steps, and
decode steps the graph does not draw), and :func:`mark_nonfinite_into` inside a
decode graph that draws the step, which counts only the step's real rows (a graph
runs over its padded batch, and a padded row's logits say nothing).
"""

from __future__ import annotations

import torch

from kvrunner.engine.step_io import NONFINITE_CAUSES

_CODE = {cause: code for code, cause in NONFINITE_CAUSES.items()}
_NAN = _CODE["logits hold NaN"]
_POS_INF = _CODE["logits hold +inf"]
_ALL_NEG_INF = _CODE["every logit is -inf"]


def _coded(tokens: torch.Tensor, row_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens`` with each non-finite row's token replaced by its cause's code, and
    the rows' non-finite mask."""
    finite = torch.isfinite(row_max)
    cause = torch.where(
        torch.isnan(row_max),
        _NAN,
        torch.where(row_max > 0, _POS_INF, _ALL_NEG_INF),
    )
    return torch.where(finite, tokens, cause.to(tokens.dtype)), ~finite


def mark_nonfinite(
    tokens: torch.Tensor, row_max: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens`` with every non-finite row's token replaced by its cause's code, and
    the number of such rows (a 0-d int64 tensor on the device; nothing is read back).

    ``row_max[i]`` is row ``i``'s largest raw logit.
    """
    coded, nonfinite = _coded(tokens, row_max)
    return coded, nonfinite.sum()


def mark_nonfinite_into(
    count: torch.Tensor,
    tokens: torch.Tensor,
    row_max: torch.Tensor,
    *,
    row_index: torch.Tensor,
    counted_rows: torch.Tensor,
) -> torch.Tensor:
    """The captured form of :func:`mark_nonfinite`: the coded tokens of every row, and
    ``count`` (a 0-d int64 device tensor) raised in place by the non-finite rows among
    the first ``counted_rows[0]``.

    Nothing here is a Python value of a step, so a CUDA graph can replay it:
    ``row_index`` is ``arange`` over at least the rows, and ``counted_rows`` a
    one-element int64 buffer the step stages before the replay (its real rows when
    the graph's draws are the step's, else 0, so a step checked after the replay, and
    a capture, count nothing here).
    """
    coded, nonfinite = _coded(tokens, row_max)
    real = row_index[: tokens.shape[0]] < counted_rows
    count.add_((nonfinite & real).sum())
    return coded
