"""A trainer rank of verl's hybrid layout on the CPU, for the plugin's tests.

verl's own trainer worker (``verl.workers.engine_workers.ActorRolloutRefWorker``)
cannot start on the CPU: every training engine verl 0.9 registers (FSDP, FSDP2,
Megatron, VeOmni, TorchTitan, AutoModel) is registered for ``cuda``/``npu``
devices only, so ``EngineRegistry`` has none to build. This worker is a verl
``Worker`` (placed by verl's ``RayWorkerGroup`` on verl's ``RayResourcePool``, its
methods dispatched by verl's ``register``) that holds a transformers model in the
engine's place and does, around it, what ``ActorRolloutRefWorker`` does in
hybrid: it builds its ``rollout`` with ``get_rollout_class(name, mode)`` and, in
``update_weights(mode="naive")``, wakes the rollout's weights, pushes the model's
``named_parameters()`` through ``rollout.update_weights`` and wakes its KV pool.
"""

from __future__ import annotations

from typing import Any

import torch
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.rollout.base import get_rollout_class


class HybridTrainerWorker(Worker):
    """One trainer rank: a transformers causal LM and its verl rollout adapter."""

    def __init__(self, config: Any, checkpoint: str) -> None:
        super().__init__()
        import transformers

        torch.set_num_threads(1)
        rollout_config = omega_conf_to_dataclass(config.rollout)
        self.free_cache_engine = rollout_config.free_cache_engine
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.float32).eval()
        self.rollout = get_rollout_class(rollout_config.name, rollout_config.mode)(
            config=rollout_config, model_config=config.model, device_mesh=None)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_step(self, seed: int, scale: float) -> None:
        """Move every weight by seeded noise (the same on every rank, as data
        parallel ranks hold the same weights after a step)."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in sorted(self.model.named_parameters()):
                p.add_(torch.randn(p.shape, generator=gen) * scale)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> None:
        """verl's naive (same-process, hybrid) weight sync."""
        if mode not in ("naive", "auto"):
            raise ValueError(f"this trainer syncs by the naive mode only, not {mode!r}")
        if self.free_cache_engine:
            await self.rollout.resume(tags=["weights"])
        await self.rollout.update_weights(self.model.named_parameters(), peft_config=None,
                                          base_sync_done=True, global_steps=global_steps)
        if self.free_cache_engine:
            await self.rollout.resume(tags=["kv_cache"])

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def num_tensors(self) -> int:
        """How many tensors a push of this model carries."""
        return len(list(self.model.named_parameters()))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """transformers' greedy continuation of ``prompt`` by ``n`` tokens on the
        trainer's current weights (the reference the pushed engine must match)."""
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(n):
                nxt = self.model(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        return ids[0, len(prompt):].tolist()
