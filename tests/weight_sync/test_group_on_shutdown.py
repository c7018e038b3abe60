"""An in-process engine's shutdown leaves its weight-update group, so the group's
name is free in that process again (torch keeps one group per name per process): a
later engine there, or a trainer's rank 0, may join a group of that name. A module
of its own: no other engine of this process holds a group while it runs."""

from __future__ import annotations

from test_update_group import ENGINE, free_port, joined

from kvrunner import LLM
from kvrunner.weight_sync.broadcaster import WeightBroadcaster


def test_shutting_down_an_in_process_engine_leaves_its_weight_update_group(
    fresh_trainer, checkpoints
) -> None:
    engine = LLM(model=str(checkpoints.path(1)), **ENGINE)
    joined(engine, fresh_trainer, checkpoints.path(1))
    engine.shutdown()
    again = WeightBroadcaster("127.0.0.1", free_port(), world_size=1, timeout_s=30)
    again.connect()  # a group of one under the same name: the name is all this checks
    again.close()
