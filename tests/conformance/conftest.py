"""Fixtures for driving the kit's mutant backends through the real engine."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvrunner import LLM
from kvrunner.models.tiny import write_tiny_checkpoint

#: a small engine over the tiny checkpoint: a few blocks, a few sequences
ENGINE_SETTINGS = dict(
    max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96, block_size=4, num_blocks=48
)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(
        write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3", kind="qwen3", seed=0)
    )


@pytest.fixture
def start(tiny_qwen3: str) -> Callable[..., LLM]:
    """``start(backend, **overrides)``: an ``LLM`` over the tiny checkpoint with
    ``backend`` serving its full-attention layers."""

    def make(backend: str, **overrides) -> LLM:
        return LLM(model=tiny_qwen3, full_attention=backend, **(ENGINE_SETTINGS | overrides))

    return make
