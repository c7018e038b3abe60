"""What ``update_weights`` accepts from a trainer, checked before a rank sees it.

A push is an iterable of ``(name, tensor)`` pairs (``model.named_parameters()``, a
generator) or a Mapping (a ``state_dict``), from CPU or GPU, in any floating dtype
(each rank casts to the model's). A value that is not a tensor, is not floating
point (an int, bool or complex tensor would be cast silently and wrongly), or holds
NaN or inf is refused with a :class:`~kvrunner.errors.WeightUpdateError`
naming it, before it reaches a parameter.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from kvrunner.errors import WeightUpdateError
from kvrunner.models.tensor_checks import all_finite, tensor_problem


def checked_pairs(
    weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    *,
    check_finite: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` as ``(name, tensor)`` pairs, each checked as it is drawn (a generator
    stays lazy: it may refill one buffer for every pair); raises WeightUpdateError
    naming the first value refused. A list, tuple or Mapping is in memory already:
    its finiteness is checked in one pass over all of it (:func:`all_finite`), and
    tensor by tensor (a wait each) only when that pass finds something to name."""
    if isinstance(weights, Mapping):
        weights = list(weights.items())
    if isinstance(weights, (str, bytes, torch.Tensor)) or not isinstance(weights, Iterable):
        raise WeightUpdateError(
            f"update_weights takes (name, tensor) pairs or a Mapping of them; got a "
            f"{type(weights).__name__}"
        )
    if check_finite and isinstance(weights, list | tuple):
        floats = [pair[1] for pair in weights if isinstance(pair, tuple | list) and len(pair) == 2
                  and isinstance(pair[1], torch.Tensor) and pair[1].is_floating_point()]
        check_finite = not all_finite(floats)
    for index, pair in enumerate(weights):
        if not (isinstance(pair, tuple | list) and len(pair) == 2 and isinstance(pair[0], str)):
            raise WeightUpdateError(
                f"update_weights item {index} is not a (name, tensor) pair: "
                f"{type(pair).__name__}"
            )
        name, value = pair
        problem = tensor_problem(value, check_finite=check_finite)
        if problem is not None:
            raise WeightUpdateError(f"tensor {name!r} {problem}; nothing of it was loaded")
        yield name, value
