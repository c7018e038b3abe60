"""An unset ``max_num_batched_tokens`` follows the device, as vLLM's ``LLM`` does.

The ranks resolve it when they start (16,384 on a GPU of 70 GiB or more, 8,192 on a
smaller one, 2,048 on the CPU); the driver builds its scheduler on what they
report, and ``llm.config`` shows that number. A value set explicitly is kept.
"""

from __future__ import annotations

import pytest
import torch

from kvrunner import LLM, SamplingParams
from kvrunner.config import ConfigError
from kvrunner.runner.model_info import agreed_batched_tokens
from kvrunner.runner.setup import default_batched_tokens, resolve_max_num_batched_tokens

GiB = 1 << 30


@pytest.mark.parametrize(
    ("device_type", "memory", "expected"),
    [
        ("cpu", 0, 2048),
        ("cpu", 512 * GiB, 2048),
        ("cuda", 24 * GiB, 8192),  # a workstation card
        ("cuda", 40 * GiB, 8192),  # A100 40 GB
        ("cuda", 70 * GiB, 16384),
        ("cuda", 80 * GiB, 16384),  # A100 / H100 80 GB
        ("cuda", 141 * 10**9, 16384),  # H200
    ],
)
def test_the_default_follows_the_device(device_type: str, memory: int, expected: int) -> None:
    assert default_batched_tokens(device_type, memory) == expected


def test_a_value_set_is_kept_on_any_device() -> None:
    assert resolve_max_num_batched_tokens(512, torch.device("cpu")) == 512
    assert resolve_max_num_batched_tokens(None, torch.device("cpu")) == 2048


def test_ranks_that_resolve_different_budgets_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"\[16384, 8192\].*set max_num_batched_tokens"):
        agreed_batched_tokens([{"max_num_batched_tokens": 16384},
                               {"max_num_batched_tokens": 8192}])
    assert agreed_batched_tokens([{"max_num_batched_tokens": 8192}] * 2) == 8192


@pytest.mark.parametrize(("asked", "resolved"), [(None, 2048), (40, 40)])
def test_the_engine_runs_on_the_budget_its_rank_resolved(asked, resolved) -> None:
    settings = {} if asked is None else {"max_num_batched_tokens": asked}
    with LLM("tiny-qwen3", max_num_seqs=4, max_model_len=128, **settings) as llm:
        assert llm.config.scheduler.max_num_batched_tokens == resolved
        assert llm.engine.scheduler.config.max_num_batched_tokens == resolved
        assert llm.executor.describe_ranks()[0]["max_num_batched_tokens"] == resolved
        # a prompt longer than an explicit budget still runs, in chunks of it
        out = llm.generate([[5] * 100], SamplingParams(max_tokens=2, temperature=0.0))
        assert len(out[0].token_ids) == 2
