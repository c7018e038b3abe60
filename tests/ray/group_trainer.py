"""A trainer's rank 0 as a Ray actor of its own (its own process), for the fleet's
group tests: it joins the fleet's weight-update group through
``FleetWeightGroup.broadcaster`` and broadcasts a checkpoint's tensors, as a
trainer on another GPU or node does.

The actor is threaded (``max_concurrency`` > 1), so a test may hold a broadcast
part way (:meth:`TrainerRank0.held`, :meth:`TrainerRank0.go`) and kill a replica
meanwhile.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import torch


def checkpoint_tensors(path: str, order_seed: int) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, in an order drawn from ``order_seed``."""
    from kvrunner.models.loader import iter_safetensors

    pairs = sorted(iter_safetensors(Path(path), torch.float32), key=lambda p: p[0])
    random.Random(order_seed).shuffle(pairs)
    return pairs


class TrainerRank0:
    """Rank 0 of a fleet's weight-update group, pushing one checkpoint per group."""

    def __init__(self) -> None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the fleet's ranks are on loopback
        torch.set_num_threads(1)
        self._sender = None
        self._pairs: list[tuple[str, torch.Tensor]] = []
        self._holding = threading.Event()
        self._go = threading.Event()

    def connect(self, plan, path: str, order_seed: int = 0) -> tuple:
        """Join the group of ``plan`` (returns once every replica rank joined too);
        returns ``(names, dtypes, shapes)`` of the push and the trainer's own
        ``tensor_digests`` of the tensors it will push."""
        from kvrunner.weight_sync.checksum import tensor_digests

        self._pairs = checkpoint_tensors(path, order_seed)
        self._sender = plan.broadcaster("cpu")
        self._sender.connect()
        return (*self._sender.spec(self._pairs), tensor_digests(dict(self._pairs),
                                                                torch.float32))

    def broadcast(self, hold_after: int | None = None) -> tuple[str, object]:
        """Broadcast every tensor (holding after ``hold_after`` of them until
        :meth:`go`); ``("broadcast", count)`` or ``("failed", message)``."""
        from kvrunner.weight_sync import WeightSyncError

        self._holding.clear()
        self._go.clear()
        try:
            return ("broadcast", self._sender.broadcast(self._held(hold_after)))
        except WeightSyncError as e:
            return ("failed", str(e))
        finally:
            self._sender.close()

    def _held(self, hold_after: int | None) -> Iterator[tuple[str, torch.Tensor]]:
        for index, pair in enumerate(self._pairs):
            if index == hold_after:
                self._holding.set()
                self._go.wait(60)
            yield pair

    def held(self) -> bool:
        """Whether the broadcast is held part way (waits up to 60 s for it)."""
        return self._holding.wait(60)

    def go(self) -> None:
        """Let a held broadcast go on."""
        self._go.set()
