"""``LLM.generate`` takes a request's ``cache_salt`` as a keyword (one for every
prompt, or one per prompt) or in vLLM's prompt dict; a bad one is refused naming the
request, before anything is queued."""

from __future__ import annotations

import pytest
from test_stale_prefix_reuse import PROMPT, SETTINGS

from kvrunner import LLM, RequestError, SamplingParams

GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-qwen3", **SETTINGS) as engine:
        yield engine


def test_a_prompt_dict_carries_its_salt_as_the_keyword_does(llm):
    (first,) = llm.generate([{"prompt_token_ids": PROMPT, "cache_salt": "dict-a"}], GREEDY)
    same, other, text = llm.generate(
        [
            PROMPT,
            {"prompt_token_ids": PROMPT, "cache_salt": "dict-b"},
            {"prompt": "a text prompt in a dict"},
        ],
        GREEDY,
        cache_salt=["dict-a", None, None],
    )
    assert (first.num_cached_tokens, same.num_cached_tokens, other.num_cached_tokens) == (0, 12, 0)
    assert same.token_ids == first.token_ids == other.token_ids
    assert text.prompt == "a text prompt in a dict" and text.token_ids


@pytest.mark.parametrize(
    ("prompts", "salt", "words"),
    [
        ([{"prompt_token_ids": PROMPT, "multi_modal_data": {}}], None, "multi_modal_data"),
        ([{"cache_salt": "x"}], None, "exactly one of 'prompt' and 'prompt_token_ids'"),
        ([{"prompt": "hi", "prompt_token_ids": [1]}], None, "exactly one"),
        ([{"prompt_token_ids": PROMPT, "cache_salt": "x"}], "y", "cache_salt is given twice"),
        (
            [PROMPT, {"prompt_token_ids": PROMPT, "cache_salt": ""}],
            None,
            "request 1: cache_salt must be a non-empty string",
        ),
        ([PROMPT, PROMPT], ["a"], "2 prompts but 1 cache salts"),
        ([PROMPT], 7, "cache_salt must be a string, None, or a list of one per prompt"),
    ],
)
def test_a_bad_salt_or_prompt_dict_is_refused_and_nothing_runs(llm, prompts, salt, words):
    with pytest.raises(RequestError, match=words):
        llm.generate(prompts, GREEDY, cache_salt=salt)
    assert not llm.engine.has_unfinished()
