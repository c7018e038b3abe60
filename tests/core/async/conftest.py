"""Fixtures for the AsyncLLM tests: two tiny checkpoints of one architecture (the
served weights and a trainer's next ones) and a small engine over the first."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from async_reference import SETTINGS, Reference

from kvrunner import LLM
from kvrunner.models.tiny import write_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("qwen3")
    return (
        str(write_tiny_checkpoint(root / "a", kind="qwen3", seed=0)),
        str(write_tiny_checkpoint(root / "b", kind="qwen3", seed=1)),
    )


@pytest.fixture(scope="module")
def served(checkpoints) -> Iterator[LLM]:
    engine = LLM(checkpoints[0], **SETTINGS)
    yield engine
    engine.shutdown()


@pytest.fixture
def llm(served: LLM, checkpoints) -> Iterator[LLM]:
    """An engine on the first checkpoint (each test wraps it in an AsyncLLM); put back
    on that checkpoint, as weight version 0, after a test that pushed other weights."""
    yield served
    served.load_weights(checkpoints[0], weight_version=0)


@pytest.fixture(scope="module")
def reference(checkpoints) -> Iterator[Reference]:
    ref = Reference(checkpoints)
    yield ref
    ref.shutdown()
