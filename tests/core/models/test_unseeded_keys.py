"""Unseeded requests are keyed by the engine: their own draws, never shared.

A request without a seed draws with a key mixed from the engine's seed and its
request id (``sampling_seeds.request_keys``). So, like a seeded request, its token
depends only on the logits, the engine seed, the request id and the tokens it has
generated; no two requests of one engine share a key (the n samples of one prompt
an RL group draws must differ); and one engine seed repeats every draw.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvrunner import LLM, SamplingParams
from kvrunner.engine.step_io import SamplingColumns
from kvrunner.layers.fused.dispatch import kernels_chosen
from kvrunner.layers.sampler import sample
from kvrunner.layers.sampling_seeds import request_keys, row_keys
from kvrunner.sampling_params import int64_seed

INT64 = st.integers(-(2**63), 2**63 - 1)


@given(engine_seed=INT64, first=st.integers(-(2**40), 2**40), n=st.integers(1, 300))
def test_one_engine_never_gives_two_requests_the_same_key(engine_seed, first, n) -> None:
    keys = request_keys(engine_seed, list(range(first, first + n)))
    assert len(set(keys)) == n
    assert all(-(2**63) <= k < 2**63 for k in keys)


@given(engine_seed=INT64, seq_id=st.integers(0, 2**40))
def test_a_key_is_a_function_of_the_engine_seed_and_the_request_alone(engine_seed, seq_id) -> None:
    alone = request_keys(engine_seed, [seq_id])
    among = request_keys(engine_seed, [seq_id + 1, seq_id, seq_id + 7])
    assert alone[0] == among[1]
    assert request_keys(engine_seed + 1, [seq_id])[0] != alone[0]


def test_a_row_with_a_seed_keeps_its_own_key_and_a_greedy_row_needs_none() -> None:
    params = [SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0)]  # fmt: skip
    keys = row_keys(SamplingColumns.of(params), [10, 11, -1], engine_seed=3)
    assert keys.tolist() == [int64_seed(5), request_keys(3, [11])[0], 0]


@pytest.mark.parametrize("triton", [True, False])
@given(data=st.data(), engine_seed=INT64)
def test_an_unseeded_rows_token_does_not_depend_on_its_batch(triton, data, engine_seed) -> None:
    """The same request, count and logits row draw the same token whoever shares the
    batch and wherever the row sits in it (both noise paths)."""
    n = data.draw(st.integers(2, 6))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    logits = torch.randn(n, 64, generator=gen)
    params = [SamplingParams(temperature=data.draw(st.floats(0.3, 2.0))) for _ in range(n)]
    seq_ids = data.draw(st.lists(st.integers(0, 10**6), min_size=n, max_size=n, unique=True))
    counts = data.draw(st.lists(st.integers(0, 500), min_size=n, max_size=n))
    order = data.draw(st.permutations(range(n)))
    with kernels_chosen(triton_on_cpu=triton):

        def draw(rows: list[int]) -> list[int]:
            columns = SamplingColumns.of(params[i] for i in rows)
            keys = row_keys(columns, [seq_ids[i] for i in rows], engine_seed)
            return sample(logits[rows], [params[i] for i in rows], [counts[i] for i in rows],
                          keys=keys).token_ids.tolist()  # fmt: skip

        together = draw(list(range(n)))
        shuffled = draw(list(order))
        alone = [draw([i])[0] for i in range(n)]
    assert [together[i] for i in order] == shuffled
    assert together == alone


def rollout(seed: int, prompt_copies: int = 8) -> list[list[int]]:
    """An RL group: one prompt sampled ``prompt_copies`` times, unseeded."""
    params = SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True)
    with LLM("tiny-qwen3", device="cpu", dtype="float32", max_num_seqs=8, max_model_len=64,
             seed=seed, enforce_eager=True) as llm:  # fmt: skip
        return [o.token_ids for o in llm.generate([[5, 6, 7, 8]] * prompt_copies, params)]


def test_the_samples_of_one_prompt_differ_and_an_engine_seed_repeats_them() -> None:
    first = rollout(seed=0)
    # Eight draws of 5 tokens from the whole vocabulary at T = 1: equal only if keys collide.
    assert len({tuple(t) for t in first}) == len(first)
    assert rollout(seed=0) == first
    assert rollout(seed=1) != first
