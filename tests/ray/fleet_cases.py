"""What the fleet tests serve and ask: engine settings, prompts, sampling, pushes."""

from __future__ import annotations

from pathlib import Path

from kvrunner import SamplingParams

#: small pools and no capture pass: start-up in seconds
SMALL = dict(enforce_eager=True, max_num_seqs=8, max_model_len=512, block_size=16,
             cpu_cache_bytes=4 << 20)
PROMPTS = [[3, 17, 29, 101], [7, 8, 9, 10, 11, 12, 13, 14, 15], [200, 201]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
#: a sampled request with its own seed draws the same on any replica
SEEDED = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)


def checkpoint_tensors(path: str) -> list:
    """The checkpoint's tensors as ``(HF name, tensor)`` pairs, as a trainer pushes them."""
    import torch

    from kvrunner.models.loader import iter_safetensors

    return list(iter_safetensors(Path(path), torch.float32))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def join_group(fleet, trainer, path: str, order_seed: int = 0) -> tuple:
    """A fresh weight-update group of the fleet's live replicas and the trainer's
    actor, which will push ``path`` (in an order drawn from ``order_seed``); returns
    the push's ``(names, dtypes, shapes, trainer's digests)``."""
    plan = fleet.weight_group_plan("127.0.0.1", free_port(), timeout_s=30)
    joined = trainer.connect.remote(plan, path, order_seed)
    assert await fleet.init_weights_update_group("127.0.0.1", plan.master_port,
                                                 timeout_s=30) == plan
    return await joined


async def push_over_group(fleet, trainer, path: str, *, version, order_seed: int = 0):
    """One push of ``path`` from the trainer's actor over a fresh group; returns the
    tensors loaded by replica and the trainer's digests of what it pushed."""
    names, dtypes, shapes, digests = await join_group(fleet, trainer, path, order_seed)
    sent = trainer.broadcast.remote()
    loaded = await fleet.update_weights_from_distributed(names, dtypes, shapes,
                                                         weight_version=version)
    assert await sent == ("broadcast", len(names))
    await fleet.destroy_weights_update_group()
    return loaded, digests
