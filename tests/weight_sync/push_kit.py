"""What the push tests share: the TP=1 engine's settings and its greedy tokens."""

from __future__ import annotations

from typing import Any

import pytest
from test_generate_hf_parity import NEW_TOKENS, PROMPTS

from kvrunner import SamplingParams
from kvrunner.errors import SleepStateError

#: the TP=1 engine of the push tests (small: the embedded test model)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_blocks=64,
              block_size=4)
#: the live server's API key and engine flags (the ``server`` fixture of conftest.py)
SERVER_KEY = "weights-key-1"
SERVER_FLAGS = ["--max-num-seqs", "4", "--max-model-len", "64", "--block-size", "4"]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def tokens(llm: Any) -> list[list[int]]:
    """The engine's greedy tokens on the parity prompts."""
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def assert_refusing(llm: Any) -> None:
    """A push failed part way: the weights are partial and generation is refused."""
    assert llm.cache_info().weights == "partial"
    with pytest.raises(SleepStateError, match="failed part way"):
        llm.generate(PROMPTS, GREEDY)
