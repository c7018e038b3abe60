"""On CUDA: the pool is sized from the memory this process really holds.

An engine dropped without ``shutdown()`` keeps its pool alive until Python collects
its reference cycles; the next engine's sizing collects first, so it gets the same
pool rather than a budget the dead engine already spent.
"""

from __future__ import annotations

import gc

import pytest
import torch

from kvrunner import LLM, SamplingParams
from kvrunner.models.tiny import write_tiny_checkpoint

pytestmark = pytest.mark.gpu
SETTINGS = dict(max_num_seqs=4, max_model_len=64, gpu_memory_utilization=0.5)


def test_an_engine_dropped_without_shutdown_leaves_its_memory_to_the_next(tmp_path) -> None:
    path = str(write_tiny_checkpoint(tmp_path / "q", kind="qwen3"))
    first = LLM(model=path, **SETTINGS)
    first.generate([[3, 4, 5]], SamplingParams(max_tokens=4))
    blocks = first.runner.num_blocks
    gc.disable()  # as between two tests: no collection happens on its own
    try:
        del first
        second = LLM(model=path, **SETTINGS)
        assert second.runner.num_blocks >= blocks * 0.95
        second.shutdown()
    finally:
        gc.enable()
    torch.cuda.empty_cache()
