"""A rank's weights: where they are, which checkpoint tensors are still to push, and
the loading of pushed or checkpoint tensors into them.

Where they are (on the device, in host memory, or discarded) is
:class:`~kvrunner.runner.weight_residency.WeightResidency`'s. What is still to push
is kept here: every tensor after a discard, and after a push that failed part way
every tensor that push did not load (whatever was pushed before it), until each is
pushed again. One driver call may arrive in several buckets, so a push is counted
from :meth:`WeightStore.begin_update` to :meth:`WeightStore.finish_update`; an
update known up front is judged whole first (:meth:`WeightStore.check`, and
:meth:`WeightStore.load` for a checkpoint), so its refusal loads nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from kvrunner.errors import SleepStateError, WeightUpdateError
from kvrunner.models.checkpoint_tensors import CheckpointTensors, load_checkpoint
from kvrunner.models.weight_names import WeightTargets
from kvrunner.models.weight_specs import TensorSpec, check_specs
from kvrunner.runner.ranks.rank_reports import PushReport
from kvrunner.runner.weight_residency import WeightResidency

#: how many of the tensors still to push an error names
MISSING_SHOWN = 8


class WeightStore:
    """One rank's model weights (its tensor-parallel shard)."""

    def __init__(self, model: Any, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.dtype = dtype
        # On CUDA this moves the weights into an allocator pool of their own (see
        # weight_residency.py).
        self.residency = WeightResidency(model, device)
        #: checkpoint names not pushed since the weights were discarded or a push failed
        self.pending: set[str] = set()
        #: names the driver's current push has loaded (see begin_update)
        self._update_loaded: set[str] = set()
        #: where the current push's names load: one walk of the model for all its parts
        self._targets: WeightTargets | None = None

    @property
    def state(self) -> str:
        """``"resident"``, ``"offloaded"`` or ``"discarded"``."""
        return self.residency.state

    @property
    def nbytes(self) -> int:
        return self.residency.nbytes

    @property
    def whole(self) -> bool:
        """Resident, with every tensor pushed since a discard or a failed push."""
        return self.state == "resident" and not self.pending

    def release(self, *, discard: bool) -> int:
        """Free the weights' device memory (kept in host memory unless ``discard``:
        then every tensor must be pushed again); returns the bytes released."""
        released = self.residency.release(discard=discard)
        if discard:
            self.pending = set(self.model.expected_weight_names())
        return released

    def restore(self) -> None:
        self.residency.restore()

    # -- pushes ----------------------------------------------------------------------

    def begin_update(self) -> None:
        """Start counting what one driver call loads (it may arrive in several buckets)."""
        self._update_loaded = set()
        self._targets = None

    def check(self, specs: list[TensorSpec]) -> None:
        """Judge one update's names and shapes whole (a name the model lacks or given
        twice, a shape its parameter refuses), loading nothing; raises
        ``WeightUpdateError`` naming the tensor."""
        self._require_resident()
        if self._targets is None:
            self._targets = self.model.weight_targets()
        try:
            check_specs(self.model, specs, whole=False, targets=self._targets)
        except ValueError as e:
            raise WeightUpdateError(f"{e}; nothing of this update was loaded") from e

    def update(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load Hugging Face-named full tensors (this rank takes its shard, in its dtype);
        returns how many were loaded. Raises ``WeightUpdateError`` naming a bad one,
        after :meth:`fail_update`."""
        self._require_resident()
        if self._targets is None:
            self._targets = self.model.weight_targets()
        loaded: set[str] = set()
        try:
            self.model.load_weights(weights, require_all=False, loaded=loaded,
                                    targets=self._targets)
        except BaseException as e:
            self._fail_after(loaded)
            if isinstance(e, ValueError) and not isinstance(e, WeightUpdateError):
                raise WeightUpdateError(str(e)) from e
            raise
        self._note_loaded(loaded)
        return len(loaded)

    def load(self, path: str, check_finite: bool = True) -> int:
        """Every tensor of a safetensors checkpoint directory (a whole model: a missing
        or unexpected tensor is refused too), as one transaction: every name, shape
        and dtype (from the headers) and, with ``check_finite``, every value is checked
        before the first tensor loads, so a refused checkpoint leaves the weights as
        they were. A fault raises ``CheckpointError`` naming the file and the tensor,
        after :meth:`fail_update`."""
        self._require_resident()
        tensors = CheckpointTensors(Path(path), self.dtype)
        loaded: set[str] = set()
        try:
            load_checkpoint(self.model, tensors, check_finite=check_finite, values_first=True,
                            loaded=loaded)
        except BaseException:
            self._fail_after(loaded)
            raise
        self._note_loaded(loaded)
        return len(loaded)

    def fail_update(self) -> PushReport:
        """A push failed part way (here or on the driver): unless the call loaded
        nothing (the weights are unchanged), every tensor it did not load is pending
        until pushed, whatever was pushed before it. ``partial``: whether the call
        loaded anything."""
        if self._update_loaded:  # idempotent: the rank and then the driver may call it
            self.pending = set(self.model.expected_weight_names()) - self._update_loaded
        return self.report(partial=bool(self._update_loaded))

    def finish_update(self, recapture: Callable[[], float]) -> PushReport:
        """After the last tensor of a push: ``recapture`` (which captures only if the
        engine is whole) and report what is still missing."""
        self._update_loaded = set()
        self._targets = None
        return self.report(recapture_s=recapture())

    def report(self, *, partial: bool = False, recapture_s: float = 0.0) -> PushReport:
        """How many tensors are still to push, and a few of their names."""
        return PushReport(pending=len(self.pending),
                          missing=tuple(sorted(self.pending)[:MISSING_SHOWN]),
                          recapture_s=recapture_s, partial=partial)

    def _require_resident(self) -> None:
        if self.state != "resident":
            raise SleepStateError(f"weights are {self.state}: wake them first")

    def _note_loaded(self, loaded: set[str]) -> None:
        self.pending -= loaded
        self._update_loaded |= loaded

    def _fail_after(self, loaded: set[str]) -> None:
        self._note_loaded(loaded)
        self.fail_update()
