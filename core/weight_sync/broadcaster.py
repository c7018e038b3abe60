"""The trainer's side of the process-group path: rank 0 of the weight-update group.

::

    sender = WeightBroadcaster("10.0.0.1", 29600, world_size=1 + engine_ranks)
    # the engine joins: init_weights_update_group("10.0.0.1", 29600, rank_offset=1,
    #                                             world_size=1 + engine_ranks)
    sender.connect()                       # returns once every engine rank joined
    # each step, while the engine runs update_weights_from_distributed(*sender.spec(w)):
    sender.broadcast(weights)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvrunner.weight_sync.layout import dtype_name
from kvrunner.weight_sync.sender import gathered
from kvrunner.weight_sync.update_group import broadcast, leave_group, make_group


class WeightBroadcaster:
    """Rank 0 of a weight-update group (it serves the group's store)."""

    def __init__(self, master_address: str, master_port: int, *, world_size: int,
                 backend: str = "gloo", group_name: str = "kvrunner_weights",
                 timeout_s: float = 300.0, device: torch.device | str = "cpu") -> None:
        self.args = dict(master_address=master_address, master_port=master_port, rank=0,
                         world_size=world_size, backend=backend, group_name=group_name,
                         timeout_s=timeout_s, is_master=True)
        self.device = torch.device(device)
        self.group = None

    def connect(self) -> None:
        """Join the group (blocks until every engine rank has joined too)."""
        self.group = make_group(**self.args, device=self.device)

    @staticmethod
    def spec(weights: Iterable[tuple[str, torch.Tensor]]
             ) -> tuple[list[str], list[str], list[list[int]]]:
        """``(names, dtypes, shapes)`` for ``update_weights_from_distributed``."""
        pairs = list(weights)
        return ([n for n, _ in pairs], [dtype_name(t.dtype) for _, t in pairs],
                [list(t.shape) for _, t in pairs])

    def close(self) -> None:
        """Leave the group (idempotent); the same name may then be joined again."""
        if self.group is not None:
            group, self.group = self.group, None
            leave_group(group)

    def broadcast(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Broadcast every tensor, in order (DTensors gathered one at a time)."""
        for _, tensor in gathered(weights):
            broadcast(self.group, tensor.to(self.device).contiguous())
