"""The capture audit's two rules and its evidence: a capture writes nothing, and its
read side is the capture step's.

*Nothing written.* Every pool's checksums are compared after each captured size
(:class:`~kvrunner.runner.capture.capture_safety.PoolSnapshot`). When a pool changed, the
audit finds out why before it raises, by running the capture forward again with
the buffers it seeded set one way or another (a fresh input token each time, so
a repeated write shows as a change):

- with every declared write target *and* every seeded buffer at PAD the forward
  still writes: **writes at PAD**, a kernel does not skip PAD rows;
- it writes only while some seeded buffer holds row indices: **undeclared target**,
  and that buffer is named;
- neither (a probe raised, or the writes come and go otherwise): the message says so.

The probes run only once a capture has already written into a pool.

*The read side is the capture step's.* The core's capture step reads one key at
block 0, with PAD on the write side; a replay with the metadata built at capture
must read nothing else until a real step refills the buffers. So each size's
capture metadata is built twice, with the seeded buffers (the builder's included)
holding different row indices each time: every integer tensor the metadata holds
must come out the same. One that follows the seeding is a read side copied from,
or pointing at, what earlier steps left: live blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from kvrunner.plugin_api.step_data import PAD_SLOT_ID, CacheWriteTarget, ForwardContext
from kvrunner.plugin_host.backend_manager import BackendManager
from kvrunner.plugin_host.held_tensors import held_tensors
from kvrunner.runner.capture.capture_safety import (
    CaptureAuditError,
    PoolSnapshot,
    seed_undeclared_index_buffers,
)
from kvrunner.runner.step.forward_vars import ForwardVars

#: ``probe(token, pad)``: blank (every target with ``pad`` when given, else its own PAD
#: value), rebuild the capture metadata and run the forward once, eagerly, with
#: ``token`` as every row's input
Probe = Callable[[int, int | None], None]


class CaptureAudit:
    """The audit of one capture loop: seeds, checks the read side, checks the pools."""

    def __init__(
        self, *, backends: BackendManager, forward_vars: ForwardVars,
        pools: Mapping[str, torch.Tensor], index_bound: int, blanking: bool,
        device: torch.device, vocab_size: int = 1,
    ) -> None:
        self.backends = backends
        self.forward_vars = forward_vars
        self.pools = dict(pools)
        self.index_bound = index_bound
        self.blanking = blanking
        self.device = device
        self.vocab_size = vocab_size
        self.snapshot = PoolSnapshot(pools)
        #: name -> (buffer, the values the last seeding gave it)
        self._seeded: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._probes = 0

    # -- seeding -------------------------------------------------------------------------

    def seed(self, targets: Sequence[CacheWriteTarget], *, offset: int = 0) -> None:
        """Seed every integer buffer the core can reach that is not a declared target:
        forward_vars and the buffers the backends hold (their builders'), never a pool."""
        candidates = {name: self.forward_vars[name] for name in self.forward_vars}
        candidates |= self.backends.held_tensors()
        by_id = {id(t): name for name, t in candidates.items()}
        seeded = seed_undeclared_index_buffers(
            candidates.values(), targets, bound=self.index_bound, offset=offset,
            exclude=self.pools.values(),
        )
        self._seeded = {by_id[id(t)]: (t, t.clone()) for t in seeded}

    # -- the read side -------------------------------------------------------------------

    def rebuild_reseeded(
        self, ctx: ForwardContext, rebuild: Callable[[], ForwardContext],
        targets: Sequence[CacheWriteTarget],
    ) -> tuple[ForwardContext, list[str]]:
        """Re-seed differently and ``rebuild`` the capture metadata; returns the rebuilt
        context (captured next) and the paths of the integer tensors in it that differ
        from ``ctx``'s (:meth:`require_read_side_from_step` judges them once the pools
        are checked, since an undeclared write target moves too)."""
        first = _integer_values(ctx)
        self.seed(targets, offset=1)
        again = rebuild()
        second = _integer_values(again)
        moved = sorted(
            path for path in first.keys() | second.keys()
            if path not in first or path not in second or first[path].shape != second[path].shape
            or not torch.equal(first[path], second[path])
        )
        return again, moved

    def require_read_side_from_step(self, batch_size: int, moved: Sequence[str]) -> None:
        """Raise :class:`CaptureAuditError` if any tensor of the capture metadata moved
        with the seeding (see :meth:`rebuild_reseeded`)."""
        if moved:
            owners = _owners(moved, self.backends)
            raise CaptureAuditError(
                f"backend {', '.join(map(repr, owners))}: the read side of its capture "
                f"metadata for batch size {batch_size} follows what earlier steps left in "
                f"its buffers ({', '.join(moved)} changed when the audit re-seeded them), "
                f"so a replay with capture-time metadata reads live blocks, not PAD or "
                f"block 0: build_capture_metadata must derive its read side from the "
                f"core's capture step, in buffers each real step refills"
            )

    # -- the pools -----------------------------------------------------------------------

    def require_pools_unchanged(
        self, batch_size: int, targets: Sequence[CacheWriteTarget], probe: Probe
    ) -> None:
        """Raise :class:`CaptureAuditError` if any pool changed, with the evidence."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if not self.snapshot.changed_pools():
            return
        culprit = None
        if self.blanking:
            evidence, culprit = self._evidence(probe, targets)
        else:
            evidence = ("Blanking is off (blank_write_targets=False), so the declared write "
                        "targets still held what the last step left.")
        self.snapshot.require_unchanged(
            batch_size=batch_size, blanked=targets if self.blanking else [], evidence=evidence,
            culprit=culprit,
        )

    def _evidence(self, probe: Probe, targets: Sequence[CacheWriteTarget]
                  ) -> tuple[str, str | None]:
        """What the probes show, and who is to blame when that is not the pools' owner
        (an overlap plugin whose undeclared mirrors the writes follow)."""
        seeded = list(self._seeded.items())

        def all_pad() -> None:
            for buffer, _ in self._seeded.values():
                buffer.fill_(PAD_SLOT_ID)

        at_pad = self._writes(probe, all_pad)
        odd = [t for t in targets if t.pad_value != PAD_SLOT_ID]
        if at_pad and odd and self._writes(probe, all_pad, pad=PAD_SLOT_ID) is False:
            named = ", ".join(f"{t.qualified_name} (pad_value={t.pad_value})" for t in odd)
            return (f"Wrong PAD value: blanked with their declared PAD values the targets "
                    f"{named} let the capture write; blanked with {PAD_SLOT_ID} instead it "
                    f"writes nothing, so the kernels skip {PAD_SLOT_ID}, not the declared "
                    f"value: declare pad_value as the value the kernels skip."), None
        if at_pad:
            return ("Writes at PAD: with every declared write target and every other "
                    "integer buffer the core reaches at PAD, the capture forward still "
                    "wrote, so a kernel does not skip the PAD rows of a write target."), None
        if at_pad is False:
            follows = []
            for name, (buffer, values) in seeded:
                def only_this(buffer: torch.Tensor = buffer, values: torch.Tensor = values) -> None:
                    all_pad()
                    buffer.copy_(values)

                if self._writes(probe, only_this):
                    follows.append(name)
            if follows:
                return (f"Undeclared target: the writes follow {follows}, which held row "
                        f"indices (seeded as serving leaves them; with them at PAD the "
                        f"capture writes nothing) and are not declared in "
                        f"cache_write_targets."), self._overlap_owner(follows)
        return ("The evidence shows neither an undeclared target nor writes at PAD alone: "
                "a kernel writes through a buffer its backend does not declare in "
                "cache_write_targets, or does not skip PAD rows."), None

    def _overlap_owner(self, buffers: Sequence[str]) -> str | None:
        """``"overlap plugin 'tbo'"`` when every buffer named is the overlap plugin's
        (forward_vars ``"<plugin>.…"``): its mirrors, not the layer backend's targets."""
        overlap = self.backends.overlap
        if overlap is not None and all(b.startswith(f"{overlap.name}.") for b in buffers):
            return f"overlap plugin {overlap.name!r}"
        return None

    def _writes(self, probe: Probe, setup: Callable[[], None], *, pad: int | None = None
                ) -> bool | None:
        """Whether one probe forward, after ``setup`` (targets blanked with ``pad`` when
        given), changes a pool (None: it raised)."""
        self._probes += 1
        token = 1 + self._probes % (self.vocab_size - 1) if self.vocab_size > 1 else 0
        try:
            setup()
            snapshot = PoolSnapshot(self.pools)
            probe(token, pad)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception:  # a read through a PAD index may fail: no evidence either way
            return None
        return bool(snapshot.changed_pools())


def _integer_values(ctx: ForwardContext) -> dict[str, torch.Tensor]:
    return {
        path: t.clone()
        for path, t in held_tensors(ctx, depth=4).items()
        if not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)
    }


def _owners(paths: Sequence[str], backends: BackendManager) -> list[str]:
    """The backends named in ``paths`` (``metadata.<backend>.…``), else every one."""
    names = set(backends.names)
    found = {part for path in paths for part in path.replace("[", ".").split(".") if part in names}
    return sorted(found) or sorted(names)
