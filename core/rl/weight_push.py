"""What ``update_weights`` accepts from a trainer, checked before a rank sees it.

A push is an iterable of ``(name, tensor)`` pairs (``model.named_parameters()``, a
generator) or a Mapping (a ``state_dict``), from CPU or GPU, in any floating dtype
(each rank casts to the model's). A pair whose name is not a ``str``, a value that
is not a tensor, is on the meta device, is not floating point (an int, bool or
complex tensor would be cast silently and wrongly), or holds NaN or inf is refused
with a :class:`~kvrunner.errors.WeightUpdateError` naming it, before it reaches a
parameter.

A list, tuple or Mapping is known up front and is checked whole before anything
loads; a generator is streamed (it may refill one buffer for every pair), so each
pair is checked as it is drawn, after the ones before it loaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from kvrunner.errors import WeightUpdateError
from kvrunner.models.tensor_checks import all_finite, tensor_problem

Pair = tuple[str, torch.Tensor]


def checked_pairs(
    weights: Iterable[Pair] | Mapping[str, torch.Tensor],
    *,
    check_finite: bool = True,
) -> list[Pair] | Iterator[Pair]:
    """``weights`` as ``(name, tensor)`` pairs; raises WeightUpdateError naming the
    first value refused. A list, tuple or Mapping comes back as a list, every pair
    checked (its finiteness in one pass over all of it, :func:`all_finite`, and
    tensor by tensor, a wait each, only when that pass finds something to name).
    Any other iterable comes back as a generator checking each pair as it is drawn
    (it stays lazy)."""
    if isinstance(weights, Mapping):
        weights = list(weights.items())
    if isinstance(weights, (str, bytes, torch.Tensor)) or not isinstance(weights, Iterable):
        raise WeightUpdateError(
            f"update_weights takes (name, tensor) pairs or a Mapping of them; got a "
            f"{type(weights).__name__}"
        )
    if not isinstance(weights, list | tuple):
        return _drawn(weights, check_finite)
    pairs = [_pair(index, pair) for index, pair in enumerate(weights)]
    if check_finite:
        check_finite = not all_finite([t for _, t in pairs if isinstance(t, torch.Tensor)
                                       and t.is_floating_point() and not t.is_meta])
    for name, value in pairs:
        _check_value(name, value, check_finite)
    return pairs


def _drawn(weights: Iterable[Any], check_finite: bool) -> Iterator[Pair]:
    for index, pair in enumerate(weights):
        name, value = _pair(index, pair)
        _check_value(name, value, check_finite)
        yield name, value


def _pair(index: int, pair: Any) -> Pair:
    if not (isinstance(pair, tuple | list) and len(pair) == 2):
        raise WeightUpdateError(
            f"update_weights item {index} is not a (name, tensor) pair: "
            f"{type(pair).__name__}"
        )
    if not isinstance(pair[0], str):
        raise WeightUpdateError(
            f"update_weights item {index}: the name must be a str (a Hugging Face tensor "
            f"name), got {type(pair[0]).__name__} {pair[0]!r:.60}"
        )
    return pair[0], pair[1]


def _check_value(name: str, value: Any, check_finite: bool) -> None:
    problem = tensor_problem(value, check_finite=check_finite)
    if problem is not None:
        raise WeightUpdateError(f"tensor {name!r} {problem}; nothing of it was loaded")
