"""A real local Ray cluster per test module, two tiny checkpoints to serve and push,
and a trainer's rank 0 as a Ray actor of its own for the weight-update group.

The cluster's CPUs are logical: bundles of one CPU each, on the machine's real
cores, whatever it has.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
from fleet_cases import GREEDY, PROMPTS, SEEDED, SMALL

from kvrunner import LLM
from kvrunner.models.tiny import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two tiny Qwen3 checkpoints of different random weights: served, pushed."""
    root = tmp_path_factory.mktemp("fleet-ckpt")
    return (str(write_tiny_checkpoint(root / "a", seed=5)),
            str(write_tiny_checkpoint(root / "b", seed=6)))


@pytest.fixture(scope="module")
def in_process(checkpoints: tuple[str, str]) -> dict[str, list[list[int]]]:
    """Each checkpoint's tokens for PROMPTS (greedy, then seeded) from an in-process LLM."""
    answers = {}
    for path in checkpoints:
        with LLM(path, **SMALL) as llm:
            answers[path] = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] + [
                o.token_ids for o in llm.generate(PROMPTS, SEEDED)]
    return answers


@pytest.fixture(scope="module")
def transformers_greedy(checkpoints: tuple[str, str]) -> dict[str, list[list[int]]]:
    """Each checkpoint's greedy tokens for PROMPTS from transformers' own model."""
    import torch
    import transformers

    answers = {}
    for path in checkpoints:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        answers[path] = [
            model.eval().generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens,
                                  min_new_tokens=GREEDY.max_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            for p in PROMPTS]
    return answers


@pytest.fixture(scope="module")
def trainer(ray_cluster) -> Iterator[Any]:
    """The trainer's rank 0: a Ray actor in a process of its own (group_trainer.py)."""
    import group_trainer

    # the workers do not have tests/ray on their path: ship the module with the class
    ray.cloudpickle.register_pickle_by_value(group_trainer)
    actor = ray.remote(group_trainer.TrainerRank0).options(
        num_cpus=0, max_concurrency=4).remote()
    yield actor
    ray.kill(actor, no_restart=True)
