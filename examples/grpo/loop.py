"""The GRPO loop: the engine (this process) draws groups of samples, the trainer
(another process) learns from them and pushes its weights back into the engine.

One step:

1. rollout: ``LLM.generate`` draws ``group_size`` samples for each prompt
   (``SamplingParams(n=group_size, logprobs=0)``, seeded), each with its sampled
   tokens' logprobs;
2. reward: exact match against the task's answer (:mod:`grpo.task`);
3. train: the trainer recomputes the sampled tokens' logprobs on the weights that
   sampled them (the rollout-vs-trainer gap), takes one policy-gradient step on
   group-normalised advantages;
   in aligned mode (the default) the engine is deterministic and the trainer's model
   runs on the engine's kernels (:func:`kvrunner.aligned.align`), in the engine's
   dtype, so the gap is exactly 0;
4. push: the trainer's :class:`~kvrunner.weight_sync.BucketSender` streams the new
   weights while the engine receives them with ``LLM.update_weights_from_ipc``.
"""

from __future__ import annotations

import multiprocessing
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import torch

from grpo import task, trainer
from grpo.policy import LEARNING_RATES, write_policy


@attrs.frozen(kw_only=True)
class Settings:
    """What a run does (the flags of run.py)."""

    steps: int = 200
    prompts_per_step: int = 8
    group_size: int = 8
    #: digits to copy (the completion's length)
    length: int = 1
    #: Adam's learning rate; None: the shape's (:data:`grpo.policy.LEARNING_RATES`)
    lr: float | None = None
    seed: int = 0
    device: str = "cpu"
    #: a key of :data:`grpo.policy.SHAPES`
    shape: str = "tiny"
    #: the engine's weight dtype: "auto" is the checkpoint's float32 on the CPU and
    #: bfloat16 on CUDA; unaligned, the trainer stays in float32, so "bfloat16" shows
    #: the gap a low-precision rollout engine opens
    engine_dtype: str = "auto"
    #: trainer-aligned mode: a deterministic engine, and the trainer on its kernels in
    #: its dtype (kvrunner.aligned), so every sampled token's logprob gap is 0
    aligned: bool = True
    bucket_bytes: int = 64 << 20
    #: torch threads of each process (the engine's and the trainer's)
    threads: int = 1
    #: print one line per step
    verbose: bool = True


@attrs.frozen(kw_only=True)
class StepRecord:
    """What one step measured."""

    step: int
    mean_reward: float
    #: mean and max |rollout logprob - trainer logprob| over the step's sampled tokens
    gap_mean: float
    gap_max: float
    rollout_s: float
    train_s: float
    push_s: float


def _engine(path: Path, settings: Settings) -> Any:
    from kvrunner import LLM

    samples = settings.prompts_per_step * settings.group_size
    sizes: dict[str, Any] = dict(max_model_len=64, max_num_seqs=min(samples, 256))
    if settings.device == "cpu":  # a small pool: the CPU has no memory to measure
        sizes |= dict(max_num_batched_tokens=max(256, samples * (settings.length + 2)),
                      block_size=4, num_blocks=samples * 2 + 16)
    return LLM(model=str(path), dtype=settings.engine_dtype, device=settings.device,
               seed=settings.seed, deterministic=settings.aligned, **sizes)


def _expect(conn: Any, kind: str, timeout_s: float = 300) -> tuple[Any, ...]:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"the trainer sent no {kind!r} within {timeout_s:g} s")
    answer = conn.recv()
    if answer[0] != kind:
        raise RuntimeError(f"the trainer answered {answer!r:.200} where {kind!r} was due")
    return answer[1:]


def run(settings: Settings) -> list[StepRecord]:
    """Train for ``settings.steps`` steps; returns one record per step."""
    from kvrunner import SamplingParams

    torch.set_num_threads(settings.threads)
    rng = random.Random(settings.seed)
    records: list[StepRecord] = []
    with tempfile.TemporaryDirectory(prefix="grpo-policy-") as directory:
        path = write_policy(Path(directory) / "policy", settings.shape, settings.seed)
        context = multiprocessing.get_context("spawn")
        conn, child = context.Pipe()
        process = context.Process(target=trainer.serve, args=(child, settings.threads),
                                  daemon=True)
        process.start()
        llm = None
        lr = settings.lr if settings.lr is not None else LEARNING_RATES[settings.shape]
        try:
            conn.send(("start", dict(path=str(path), device=settings.device, lr=lr,
                                     seed=settings.seed, group_size=settings.group_size,
                                     bucket_bytes=settings.bucket_bytes)))
            address, authkey = _expect(conn, "ready")
            llm = _engine(path, settings)
            if settings.aligned:
                conn.send(("align", llm.config))
                _expect(conn, "aligned")
            for step in range(settings.steps):
                records.append(_step(llm, conn, address, authkey, settings, rng, step,
                                     SamplingParams))
                if settings.verbose:
                    _print(records[-1])
        finally:
            conn.send(None)
            process.join(30)
            if llm is not None:
                llm.shutdown()
    return records


def _step(llm: Any, conn: Any, address: Any, authkey: bytes, settings: Settings,
          rng: random.Random, step: int, sampling_params: Any) -> StepRecord:
    started = time.perf_counter()
    prompts = task.draw_prompts(rng, settings.prompts_per_step, settings.length)
    params = [sampling_params(n=settings.group_size, max_tokens=settings.length,
                              temperature=1.0, logprobs=0, ignore_eos=True,
                              seed=rng.getrandbits(62)) for _ in prompts]
    outputs = llm.generate(prompts, params)
    rollout_s = time.perf_counter() - started
    # outputs come in prompt order, a prompt's n samples in a row: groups are rows
    rows = [prompts[i // settings.group_size] for i in range(len(outputs))]
    rewards = [task.reward(p, o.token_ids) for p, o in zip(rows, outputs, strict=True)]
    conn.send(("step", dict(prompts=rows, completions=[o.token_ids for o in outputs],
                            logprobs=[o.logprobs for o in outputs], rewards=rewards)))
    (stats,) = _expect(conn, "trained")
    pushed = time.perf_counter()
    llm.update_weights_from_ipc(address, authkey=authkey, timeout_s=120)
    loaded, _trainer_push_s = _expect(conn, "pushed")
    if loaded == 0:
        raise RuntimeError("the push loaded no tensors")
    return StepRecord(step=step, mean_reward=sum(rewards) / len(rewards),
                      gap_mean=stats["gap_mean"], gap_max=stats["gap_max"],
                      rollout_s=rollout_s, train_s=stats["train_s"],
                      push_s=time.perf_counter() - pushed)


def _print(record: StepRecord) -> None:
    print(f"step {record.step:4d}  reward {record.mean_reward:.3f}  "
          f"|dlogp| mean {record.gap_mean:.2e} max {record.gap_max:.2e}  "
          f"rollout {record.rollout_s * 1e3:6.1f} ms  train {record.train_s * 1e3:6.1f} ms  "
          f"push {record.push_s * 1e3:6.1f} ms", flush=True)
