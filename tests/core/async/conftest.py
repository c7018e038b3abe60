"""Fixtures for the AsyncLLM tests: two tiny checkpoints of one architecture (the
served weights and a trainer's next ones) and a small engine over the first."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvrunner import LLM
from kvrunner.models.tiny import write_tiny_checkpoint

#: 4 seats and a pool of 24 blocks of 4 tokens: a few requests run at once, more queue
SETTINGS = dict(
    max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4,
    num_blocks=24, capture_sizes=(1, 2, 4),
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("qwen3")
    return (
        str(write_tiny_checkpoint(root / "a", kind="qwen3", seed=0)),
        str(write_tiny_checkpoint(root / "b", kind="qwen3", seed=1)),
    )


@pytest.fixture(scope="module")
def llm(checkpoints) -> Iterator[LLM]:
    """An engine on the first checkpoint; each test wraps it in an AsyncLLM."""
    engine = LLM(checkpoints[0], **SETTINGS)
    yield engine
    engine.shutdown()
