"""A real local Ray cluster per test module, and two tiny checkpoints to serve and push.

The cluster's CPUs are logical: bundles of one CPU each, on the machine's real
cores, whatever it has.
"""

from __future__ import annotations

from collections.abc import Iterator

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
