"""The trainer: a plain torch model in its own process.

It loads the policy checkpoint, and for each step it is sent (prompts, the engine's
samples, their rewards and the engine's logprobs). It recomputes the sampled
tokens' logprobs on its weights, which are the weights that sampled them (the gap
is the rollout-vs-trainer mismatch), takes one GRPO policy-gradient step, and
pushes its new weights to the engine through a
:class:`~kvrunner.weight_sync.BucketSender` (shared memory on the CPU, CUDA IPC on
a GPU).

Each exchange on the pipe is one request and its answers:

* ``("start", settings)`` -> ``("ready", address, authkey)``
* ``("align", engine_config)`` -> ``("aligned",)``: the model, reloaded in the
  engine's dtype, runs on the engine's kernels from now on (:func:`kvrunner.aligned.align`)
* ``("step", batch)`` -> ``("trained", stats)``, then (once the engine has pulled
  the push) ``("pushed", loaded, seconds)``
* ``None`` -> the process ends.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Any

import torch


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """GRPO's advantages: each reward minus its group's mean, over the group's
    standard deviation (a group whose rewards are all equal has advantage 0)."""
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    return (centred / (groups.std(dim=1, keepdim=True) + 1e-4)).view(-1)


def sampled_logprobs(model: torch.nn.Module, prompts: torch.Tensor,
                     completions: torch.Tensor) -> torch.Tensor:
    """The log-probability the model gives each sampled completion token
    (``[samples, completion length]``), computed in one forward pass."""
    from kvrunner.aligned import token_logprobs

    ids = torch.cat([prompts, completions], dim=1)
    logits = model(input_ids=ids).logits
    width = completions.shape[1]
    # position t's logits predict token t + 1: the completion's come from the
    # prompt's last position up to the completion's second last
    predicting = logits[:, prompts.shape[1] - 1 : prompts.shape[1] - 1 + width]
    # the engine's sampler's own log-softmax (float32 whatever the logits' dtype)
    return token_logprobs(predicting, completions)


class Trainer:
    """The policy, its optimiser and its sender (one per trainer process)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from kvrunner.weight_sync import BucketSender

        torch.manual_seed(settings["seed"])
        self.settings = settings
        self.device = torch.device(settings["device"])
        self._load(torch.float32)
        self.group_size: int = settings["group_size"]
        self.sender = BucketSender(device=self.device, bucket_bytes=settings["bucket_bytes"],
                                   timeout_s=120)

    def _load(self, dtype: torch.dtype) -> None:
        """The policy checkpoint in ``dtype`` on the device, and a fresh optimiser."""
        import transformers

        self.model = transformers.Qwen3ForCausalLM.from_pretrained(
            self.settings["path"], dtype=dtype).to(self.device)
        self.model.train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=self.settings["lr"])

    def align(self, engine: Any) -> None:
        """Reload the policy in the engine's dtype (before any step: the same starting
        weights) and run it on the engine's kernels (``kvrunner.aligned.align``, which
        refuses an engine it cannot match, naming the difference)."""
        from kvrunner.aligned import align
        from kvrunner.runner.setup import resolve_dtype

        dtype = resolve_dtype(engine.dtype, self.device, self.model.config.to_dict())
        if dtype != self.model.dtype:
            self._load(dtype)
        align(self.model, engine)

    def step(self, batch: dict[str, Any]) -> dict[str, float]:
        """One GRPO step on ``batch`` (prompts, completions, rewards and the engine's
        logprobs, one row per sample, groups of ``group_size`` in a row)."""
        started = time.perf_counter()
        prompts = torch.tensor(batch["prompts"], device=self.device)
        completions = torch.tensor(batch["completions"], device=self.device)
        rollout = torch.tensor(batch["logprobs"], device=self.device, dtype=torch.float32)
        rewards = torch.tensor(batch["rewards"], device=self.device, dtype=torch.float32)
        logprobs = sampled_logprobs(self.model, prompts, completions)
        gap = (logprobs.detach() - rollout).abs()
        advantages = group_advantages(rewards, self.group_size)
        # on-policy, one update per batch: the importance ratio is 1, so the clipped
        # surrogate is the plain policy gradient, averaged over tokens
        loss = -(advantages.unsqueeze(1) * logprobs).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"loss": float(loss.detach()), "gap_mean": float(gap.mean()),
                "gap_max": float(gap.max()), "train_s": time.perf_counter() - started}

    def push(self) -> tuple[int, float]:
        """Push every parameter to the engine (which connects meanwhile); returns the
        count it loaded and the seconds the push took."""
        started = time.perf_counter()
        loaded = self.sender.push(self.model.named_parameters())
        return loaded, time.perf_counter() - started


def serve(conn: Connection, threads: int) -> None:
    """The trainer process's body: answer the pipe's requests until ``None``."""
    torch.set_num_threads(threads)
    trainer: Trainer | None = None
    while (request := conn.recv()) is not None:
        kind, payload = request
        if kind == "start":
            trainer = Trainer(payload)
            conn.send(("ready", trainer.sender.address, trainer.sender.authkey))
        elif kind == "align" and trainer is not None:
            trainer.align(payload)
            conn.send(("aligned",))
        elif kind == "step" and trainer is not None:
            conn.send(("trained", trainer.step(payload)))
            conn.send(("pushed", *trainer.push()))
        else:
            raise ValueError(f"the trainer got {kind!r} before 'start' or an unknown request")
    if trainer is not None:
        trainer.sender.close()
