"""What every rank of a replica does first in its Ray actor: its config, its
threads, and the rendezvous store of its replica's group.

Ray gives each actor its bundle's resources: on GPUs, ``CUDA_VISIBLE_DEVICES``
holds the one card of its bundle, so the rank's device is ``cuda:0`` in its own
process; on the CPU, ``num_cpus_per_rank`` cores, which bound torch's threads.
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from kvrunner.config import EngineConfig


@attrs.frozen(kw_only=True)
class RankSpec:
    """How one replica's ranks start (picklable; the same for every rank of it).

    :ivar model: the checkpoint directory or embedded default every rank loads.
    :ivar config: flat ``EngineConfig`` overrides (as ``LLM(**config)`` takes them).
    :ivar tensor_parallel_size: ranks in the replica's group.
    :ivar cpu_threads: torch intra-op threads of a rank on the CPU (0: leave as is).
    """

    model: str | None
    config: dict[str, Any]
    tensor_parallel_size: int
    cpu_threads: int = 1

    def engine_config(self) -> EngineConfig:
        """The config every rank builds its runner from."""
        if self.tensor_parallel_size == 1:
            return EngineConfig.load(None, model=self.model, **self.config)
        # The ranks are started from outside (here: by Ray), as under torchrun.
        return EngineConfig.load(
            None, model=self.model, tensor_parallel_size=self.tensor_parallel_size,
            distributed_executor="torchrun", **self.config,
        )


def prepare_process(spec: RankSpec, *, loopback: bool) -> None:
    """Set this actor's torch threads (CPU) and keep gloo on the loopback device
    when every rank of the replica is on this host (gloo otherwise binds to what
    the host name resolves to, which a container may not route)."""
    import torch

    if spec.cpu_threads > 0 and not torch.cuda.is_available():
        torch.set_num_threads(spec.cpu_threads)
    if loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def node_address() -> str:
    """The IP address of the node this actor runs on."""
    import ray

    return ray.util.get_node_ip_address()
