"""On CUDA: the pool is sized from the memory this process really holds.

An engine dropped without ``shutdown()`` keeps its pool alive until Python collects
its reference cycles; the next engine's sizing collects first, so it gets the same
pool rather than a budget the dead engine already spent. An unset step budget
follows the card's memory.
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
    blocks = first.runner.pool_size.num_blocks
    gc.disable()  # as between two tests: no collection happens on its own
    try:
        del first
        second = LLM(model=path, **SETTINGS)
        assert second.runner.pool_size.num_blocks >= blocks * 0.95
        second.shutdown()
    finally:
        gc.enable()
    torch.cuda.empty_cache()



def test_an_unset_step_budget_follows_the_cards_memory(tmp_path) -> None:
    """16,384 tokens a step on a card of 70 GiB or more (8,192 below): the runner's
    buffers and the sizing's profiled prefill take that many, and eight prompts of
    the model's longest length (4,096 tokens) prefill together."""
    path = str(write_tiny_checkpoint(tmp_path / "q", kind="qwen3"))
    total = torch.cuda.get_device_properties(0).total_memory
    expected = 16384 if total >= 70 << 30 else 8192
    with LLM(model=path, max_num_seqs=8, max_model_len=4096, gpu_memory_utilization=0.5) as llm:
        assert llm.config.scheduler.max_num_batched_tokens == expected
        assert llm.runner.max_tokens == expected
        prompts = [[3 + i] * 4000 for i in range(8)]
        out = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0))
        assert [len(o.token_ids) for o in out] == [2] * 8
