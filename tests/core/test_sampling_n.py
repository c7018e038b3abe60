"""``SamplingParams(n=k)``: k samples per prompt, flat and prompt-major, each drawn
exactly as a single request with ``for_sample(k)``, sharing the prompt's KV through
the prefix cache."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrunner import LLM, RequestError, RequestOutput, SamplingParams
from kvrunner.llm import RequestOutput as LLMRequestOutput

# block_size 4 so that a short prompt spans several shareable blocks
ENGINE = dict(max_num_seqs=8, max_model_len=64, num_blocks=64, block_size=4,
              enforce_eager=True)
PROMPTS = [[5, 9, 2, 7, 11, 3, 8, 1, 4, 6, 10], [12, 13, 14, 15, 16, 17, 18, 19, 20]]


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-qwen3", **ENGINE) as llm:
        yield llm


def test_request_output_is_one_type_everywhere() -> None:
    assert LLMRequestOutput is RequestOutput


@given(seed=st.integers(min_value=0, max_value=2**62), n=st.integers(min_value=1, max_value=6))
def test_for_sample_seeds_differ_and_repeat(seed: int, n: int) -> None:
    params = SamplingParams(n=n, seed=seed)
    samples = [params.for_sample(k) for k in range(n)]
    assert all(s.n == 1 for s in samples)
    assert samples[0].seed == seed  # n=1 and sample 0 draw the same tokens
    seeds = [s.seed for s in samples]
    assert len(set(seeds)) == n
    assert seeds == [SamplingParams(n=n, seed=seed).for_sample(k).seed for k in range(n)]
    assert all(0 <= s < 2**63 for s in seeds)  # an int64 key, as the sampler needs
    assert [attrs_without_seed(s) for s in samples] == [attrs_without_seed(params)] * n


def attrs_without_seed(params: SamplingParams) -> tuple:
    return (params.max_tokens, params.temperature, params.top_k, params.top_p,
            params.ignore_eos, params.stop_token_ids, params.logprobs)


def test_for_sample_unseeded_keeps_no_seed() -> None:
    params = SamplingParams(n=3)
    assert [params.for_sample(k).seed for k in range(3)] == [None] * 3


@pytest.mark.parametrize("k", [-1, 3, 1.0, "1", True, None])
def test_for_sample_refuses_an_index_outside_the_group(k) -> None:
    with pytest.raises(RequestError, match=r"sample index must be an integer in \[0, 3\)"):
        SamplingParams(n=3).for_sample(k)


@pytest.mark.parametrize(("n", "named"), [
    (0, "n must be >= 1"), (2.0, "n must be an integer"), ("2", "n must be an integer"),
    (True, "n must be an integer"),
])
def test_bad_n_is_refused_naming_the_field(n, named) -> None:
    with pytest.raises(RequestError, match=f"SamplingParams.{named}"):
        SamplingParams(n=n)


def test_n_samples_are_flat_prompt_major_and_equal_single_requests(llm) -> None:
    params = [SamplingParams(n=3, seed=11, max_tokens=6, ignore_eos=True, temperature=1.0),
              SamplingParams(n=2, seed=23, max_tokens=5, ignore_eos=True, temperature=0.8)]
    outs = llm.generate(PROMPTS, params)
    assert [(o.prompt_token_ids, o.sample_index) for o in outs] == [
        (PROMPTS[0], 0), (PROMPTS[0], 1), (PROMPTS[0], 2), (PROMPTS[1], 0), (PROMPTS[1], 1)]
    assert len({o.request_id for o in outs}) == 5
    # the samples of a group differ (a random tiny model at T~1 is near uniform)
    assert len({tuple(o.token_ids) for o in outs[:3]}) == 3
    # sample k is exactly the single request with for_sample(k), prefix cache or not
    llm.reset_prefix_cache()
    singles = llm.generate([PROMPTS[0]] * 3 + [PROMPTS[1]] * 2,
                           [params[0].for_sample(k) for k in range(3)]
                           + [params[1].for_sample(k) for k in range(2)])
    assert [o.token_ids for o in outs] == [o.token_ids for o in singles]
    assert all(o.sample_index == 0 for o in singles)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_group_samples_share_the_prompt_through_the_prefix_cache(async_scheduling) -> None:
    n = 4
    with LLM("tiny-qwen3", **dict(ENGINE, async_scheduling=async_scheduling)) as llm:
        llm.generate(PROMPTS, SamplingParams(n=n, seed=5, max_tokens=3, ignore_eos=True))
        hits = llm.cache_info().prefix_hit_tokens
    # every sample after the first finds every full block of the prompt but the one
    # holding its last token (that token is computed, to sample from)
    block = ENGINE["block_size"]
    shared = sum((len(p) - 1) // block * block for p in PROMPTS)
    assert hits == (n - 1) * shared


def test_greedy_group_is_n_copies(llm) -> None:
    outs = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=0.0, max_tokens=5))
    assert [o.sample_index for o in outs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in outs}) == 1


def test_engine_refuses_a_group_as_one_request(llm) -> None:
    with pytest.raises(RequestError, match="n=2 asks for a group"):
        llm.engine.make_request(PROMPTS[0], SamplingParams(n=2), 0)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_groups_under_preemption_finish_with_the_single_requests_tokens(
    async_scheduling: bool,
) -> None:
    """A pool too small for every sample at once preempts some; every group still ends,
    each sample with the tokens it draws alone."""
    params = SamplingParams(n=4, seed=9, max_tokens=12, ignore_eos=True)
    small = dict(ENGINE, num_blocks=14, async_scheduling=async_scheduling)
    with LLM("tiny-qwen3", **small) as llm:
        outs = llm.generate(PROMPTS, params)
        assert llm.engine.scheduler.num_preemptions > 0  # the case this test is about
        llm.reset_prefix_cache()
        singles = [llm.generate(p, params.for_sample(k))[0]
                   for p in PROMPTS for k in range(4)]
    assert [o.token_ids for o in outs] == [o.token_ids for o in singles]
    assert all(len(o.token_ids) == 12 for o in outs)


def test_a_model_without_prefix_caching_serves_groups_without_waiting() -> None:
    """The hybrid model's recurrent state is not in any block: no sharing, and a sample
    waits for nobody."""
    params = SamplingParams(n=3, seed=2, max_tokens=4, ignore_eos=True)
    with LLM("tiny-qwen3-next", **ENGINE) as llm:
        assert not llm.engine.block_manager.enable_prefix_caching
        outs = llm.generate(PROMPTS[0], params)
        assert llm.cache_info().prefix_hit_tokens == 0
        singles = [llm.generate(PROMPTS[0], params.for_sample(k))[0] for k in range(3)]
    assert [o.token_ids for o in outs] == [o.token_ids for o in singles]
    assert [o.sample_index for o in outs] == [0, 1, 2]
