"""The step audit: with ``audit=True`` every real step proves it wrote only where it was told.

The capture audit (``runner/capture/``) covers the captures; this covers every
step after them, eager or replayed. Around each step it checks three rules:

- *A step writes only the slots it was given.* Each pool's per-row checksums
  (:mod:`~kvrunner.runner.pools.pool_rows`) are taken before the step and after it;
  every row that changed must be one this step's schedule assigned: a KV slot in the
  slot mapping of its real tokens, or a request slot of one of its sequences. A
  changed row outside them is a :class:`StepAuditError` naming the backend, the
  layer, the buffer, the block and the slot.
- *The core's step buffers are the core's.* ``input_ids`` and the shared read side
  (positions, query starts, context lengths, block tables) are filled by the core
  before the backends build their metadata; a copy is taken then and compared after
  each backend's hook and after the forward. A backend that writes one (rotary reads
  ``positions``) is named with the hook or the forward that did it.
- *Write targets keep their identity.* The write targets are asked for once per
  step, which checks each is still the tensor it first was
  (:func:`~kvrunner.plugin_host.write_targets.require_fixed_identity`).

The checks read every pool twice per step and wait for the device, so the audit
is for tests, bring-up and a canary replica, not for every replica of a fleet
(docs/benchmarks.md has its cost).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from kvrunner.plugin_api.errors import BackendError
from kvrunner.plugin_api.step_data import StepBatch
from kvrunner.plugin_host.backend_manager import BackendManager
from kvrunner.runner.pools.pool_rows import PoolRows, pool_rows, row_checksums

#: how many changed rows outside the step's slots a message lists
SHOWN = 4


class StepAuditError(BackendError):
    """A step broke the step contract: it changed a pool row its schedule did not
    assign, or a buffer the core owns. The message names the backend and what it did."""


class StepAudit:
    """One rank's step audit (see the module docstring).

    :param pools: the pools now allocated (asked at every step: a wake allocates new ones).
    :param core_buffers: the buffers the core owns and fills before the backends run.
    """

    def __init__(
        self, *, backends: BackendManager, pools: Callable[[], Mapping[str, torch.Tensor]],
        core_buffers: Mapping[str, torch.Tensor], block_size: int,
    ) -> None:
        self.backends = backends
        self._pools = pools
        self.core_buffers = dict(core_buffers)
        self.block_size = block_size
        #: the pools through cache_rows, for one step: views that keep the pools alive,
        #: so dropped when the step ends (a sleep must free them)
        self._rows: list[PoolRows] = []
        self._before: list[torch.Tensor] = []
        self._core_copy: dict[str, torch.Tensor] = {}
        #: steps checked since start
        self.steps = 0

    def begin(self) -> None:
        """Before the backends build the step's metadata (the core's buffers are filled):
        copy the core's buffers and checksum every pool row."""
        self._core_copy = {name: t.clone() for name, t in self.core_buffers.items()}
        self._rows = pool_rows(self._pools(), self.backends.cache_rows)
        self._before = [row_checksums(p.rows) for p in self._rows]
        self.backends.observer = self._after_hook

    def end(self, batch: StepBatch) -> None:
        """After the step's forward: raise :class:`StepAuditError` if a rule broke."""
        rows, before = self._rows, self._before
        self.abandon()
        self._require_core_buffers("the forward")
        self.backends.cache_write_targets()  # checks each target is still its tensor
        kv_slots = set(batch.slot_mapping[: batch.num_tokens].tolist())
        state_slots = set(batch.state_slots[: batch.num_seqs].tolist())
        for pool, sums in zip(rows, before, strict=True):
            changed = (row_checksums(pool.rows) != sums).any(dim=1).nonzero().flatten()
            given = kv_slots if pool.kind == "kv" else state_slots
            outside = [row for row in changed.tolist() if row not in given]
            if outside:
                raise StepAuditError(self._outside_message(pool, outside, batch))
        self.steps += 1

    def abandon(self) -> None:
        """Stop watching the hooks and let go of the pools (also for a step that
        raised before :meth:`end`)."""
        self.backends.observer = None
        self._rows, self._before = [], []

    # -- the rules ---------------------------------------------------------------------

    def _after_hook(self, backend: str, hook: str) -> None:
        self._require_core_buffers(f"backend {backend!r}'s {hook}", backend=backend)

    def _require_core_buffers(self, where: str, *, backend: str | None = None) -> None:
        changed = [name for name, t in self.core_buffers.items()
                   if not torch.equal(t, self._core_copy[name])]
        if changed:
            self.backends.observer = None
            who = f"backend {backend!r}" if backend else (
                f"backend(s) {', '.join(map(repr, self.backends.names))}")
            raise StepAuditError(
                f"{who}: {where} wrote the core's step buffer(s) {changed}, which the core "
                f"fills for every backend and the model reads (positions feeds the rotary "
                f"embedding): a backend only reads them; keep what it derives in buffers "
                f"of its own"
            )

    def _outside_message(self, pool: PoolRows, outside: list[int], batch: StepBatch) -> str:
        layer = f"layer {pool.layer}" if pool.layer is not None else "its layer"
        if pool.kind == "kv":
            where = ", ".join(f"slot {s} (block {s // self.block_size}, offset "
                              f"{s % self.block_size})" for s in outside[:SHOWN])
            given = f"the {batch.num_tokens} slots of its tokens' slot mapping"
        else:
            where = ", ".join(f"request slot {s}" for s in outside[:SHOWN])
            given = f"the state slots of its {batch.num_seqs} sequences"
        more = f" and {len(outside) - SHOWN} more" if len(outside) > SHOWN else ""
        return (
            f"backend {pool.backend!r}: a step wrote {layer}'s buffer {pool.buffer!r} at "
            f"{where}{more}, outside {given} ({batch.num_seqs} sequences, "
            f"{batch.num_padded_seqs - batch.num_seqs} padded): a step writes only the "
            f"slots it was given (a stale or shifted slot mapping, a padded tail not at "
            f"PAD, or a kernel that does not skip PAD rows writes elsewhere)"
        )
