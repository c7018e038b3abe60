"""A weight update judged whole before a byte of it loads.

An update whose contents are known up front (a list or Mapping of pushed tensors, a
checkpoint directory, a weight-update group's announced names) is described by a
:class:`TensorSpec` per tensor: its name, shape and dtype, read from the tensor or
from a file's header without its values. :func:`check_specs` runs them through the
model's own loading rule on meta-device twins of its parameters
(``load_weights(..., dry_run=True)``): a name the model does not have, a name given
twice, a shape its ``weight_loader`` refuses and, for a whole checkpoint, a name it
lacks, each raise the error a real load would, and nothing is copied.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch

from kvrunner.models.tensor_checks import dtype_problem
from kvrunner.models.weight_names import WeightTargets


@attrs.frozen
class TensorSpec:
    """One tensor of an update, without its values."""

    name: str
    shape: tuple[int, ...]
    #: as its source spells it: ``"float32"`` (torch), ``"F32"`` (a safetensors header)
    dtype: str
    floating: bool

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        """The spec of a tensor in memory."""
        return cls(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."),
                   tensor.is_floating_point())

    def problem(self) -> str | None:
        """Why this tensor's dtype cannot be loaded (None: it can)."""
        return dtype_problem(self.dtype, floating=self.floating)


def check_specs(
    model: Any, specs: Sequence[TensorSpec], *, whole: bool,
    targets: WeightTargets | None = None,
) -> None:
    """Judge an update's names and shapes as ``model.load_weights`` would, copying
    nothing. ``whole``: the update is a whole checkpoint (a name it lacks is refused
    too); else any subset of the model's tensors.

    :raises ValueError: the model's own refusal (``WeightNameError``,
        ``WeightShapeError``, ``WeightDuplicateError``, ``WeightSetError``), naming the
        tensor.
    """
    model.load_weights(_shaped(specs), require_all=whole, targets=targets, dry_run=True)


#: float8 dtypes by the names torch and safetensors headers give them: an FP8 tensor
#: loads by another rule than a float one (its bytes as stored, beside its scales)
_FLOAT8 = {"float8_e4m3fn": torch.float8_e4m3fn, "F8_E4M3": torch.float8_e4m3fn,
           "float8_e5m2": torch.float8_e5m2, "F8_E5M2": torch.float8_e5m2}


def _shaped(specs: Iterable[TensorSpec]) -> Iterable[tuple[str, torch.Tensor]]:
    for spec in specs:
        yield spec.name, torch.empty(spec.shape, device="meta",
                                     dtype=_FLOAT8.get(spec.dtype, torch.float32))
