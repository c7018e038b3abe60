"""A rank > 0 of a replica's tensor-parallel group, as a Ray actor.

It joins the group rank 0 serves the store of and then runs rank 0's commands
(steps and calls, broadcast over the group as under torchrun: see
:mod:`kvrunner.runner.ranks.broadcast_executor`) on a thread of its own, until rank 0
shuts down. A rank that fails reports it in the store for rank 0 to raise as a
``WorkerError`` naming it, and its process ends, so Ray sees the actor die.
"""

from __future__ import annotations

import threading

from kvrunner.ray.rank_setup import RankSpec, node_address, prepare_process


class EngineRank:
    """One rank > 0 (plain class: :class:`~kvrunner.ray.fleet.RolloutFleet` makes it a
    Ray actor on its bundle)."""

    def __init__(self, spec: RankSpec, rank: int) -> None:
        self.spec = spec
        self.rank = rank
        self._thread: threading.Thread | None = None

    def node_address(self) -> str:
        """The IP address of this actor's node."""
        return node_address()

    def start(self, host: str, port: int, *, loopback: bool) -> None:
        """Join rank 0's group at ``host:port`` and serve it, on a thread; returns at
        once (the group forms when every rank has joined)."""
        from kvrunner.distributed.group import connect_store
        from kvrunner.launch import join_group

        if self._thread is not None:
            raise RuntimeError(f"rank {self.rank} was started already")
        prepare_process(self.spec, loopback=loopback)
        cfg = self.spec.engine_config()
        store = connect_store(host, port, timeout_s=cfg.parallel.distributed_timeout_s,
                              is_master=False)

        def serve() -> None:
            join_group(cfg, store=store, rank=self.rank, world=self.spec.tensor_parallel_size,
                       local_rank=0)

        self._thread = threading.Thread(target=serve, name=f"kvrunner-rank-{self.rank}",
                                        daemon=True)
        self._thread.start()

    def serving(self) -> bool:
        """Whether this rank still serves its group (False once rank 0 released it)."""
        return self._thread is not None and self._thread.is_alive()
