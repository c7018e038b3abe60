"""The seeded-row noise kernel (Triton; under the interpreter without a GPU): a row's
draws are a function of its (seed, tokens generated) alone, uniform on [0, 1), and
the sampler built on them keeps its guarantees: a seeded request's token does not
depend on its batch, and draws follow the filtered distribution."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvrunner.layers.fused.dispatch import kernels_chosen
from kvrunner.layers.fused.seeded_uniform_triton import seeded_uniform_
from kvrunner.layers.sampler import sample
from kvrunner.sampling_params import SamplingParams

pytest.importorskip("triton")
seeds = st.integers(-(2**63), 2**63 - 1)
counts = st.integers(0, 100_000)


@pytest.fixture(scope="module", autouse=True)
def triton_sampling_path():
    """The sampler takes the kernel path on the CPU too, for this module."""
    with kernels_chosen(triton_on_cpu=True):
        yield


def draws(rows: int, vocab: int, at: list[int], keys: list[tuple[int, int]]) -> torch.Tensor:
    """``u[at[i]]`` drawn for ``keys[i] = (seed, count)``; other rows stay -1."""
    u = torch.full((rows, vocab), -1.0)
    seed_list, count_list = zip(*keys, strict=True)
    return seeded_uniform_(u, torch.tensor(at), torch.tensor(seed_list), torch.tensor(count_list))


@given(st.lists(st.tuples(seeds, counts), min_size=1, max_size=4, unique=True),
       st.integers(1, 300), st.data())
def test_a_rows_draws_depend_on_its_seed_and_count_alone(keys, vocab: int, data) -> None:
    rows = len(keys) + data.draw(st.integers(0, 3))
    at = data.draw(st.permutations(range(rows)))[: len(keys)]
    u = draws(rows, vocab, at, keys)
    for row, key in zip(at, keys, strict=True):
        assert torch.equal(u[row], draws(1, vocab, [0], [key])[0])
        assert ((u[row] >= 0) & (u[row] < 1)).all()
    untouched = [r for r in range(rows) if r not in at]
    assert (u[untouched] == -1.0).all()


@given(st.tuples(seeds, counts), st.tuples(seeds, counts))
def test_another_seed_or_count_draws_differently(a, b) -> None:
    if a == b:
        return
    assert not torch.equal(draws(1, 64, [0], [a])[0], draws(1, 64, [0], [b])[0])


@given(seeds)
def test_each_generated_token_draws_afresh(seed: int) -> None:
    rows = draws(30, 64, list(range(30)), [(seed, count) for count in range(30)])
    assert len({tuple(row.tolist()) for row in rows}) == 30


def test_draws_are_uniform() -> None:
    u = draws(1, 20000, [0], [(12345, 7)])[0].double().sort().values
    # Kolmogorov-Smirnov: the empirical CDF stays within ~1.95 / sqrt(n) (p = 0.001)
    ecdf = torch.arange(1, u.numel() + 1, dtype=torch.float64) / u.numel()
    assert (ecdf - u).abs().max() < 1.95 / u.numel() ** 0.5


@given(st.integers(0, 2**40), st.integers(0, 500), st.integers(2, 5), st.data())
def test_seeded_token_does_not_depend_on_its_batch(seed: int, count: int, rows: int, data) -> None:
    logits = torch.randn(rows, 40, generator=torch.Generator().manual_seed(seed % 1000))
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(rows)]
    counts = [count] * rows
    row = data.draw(st.integers(0, rows - 1))
    params[row] = SamplingParams(temperature=0.7, top_k=20, seed=seed)
    alone = sample(logits[row : row + 1], [params[row]], [count]).token_ids[0]
    in_batch = sample(logits, params, counts).token_ids[row]
    flipped = sample(logits.flip(0), params[::-1], counts[::-1]).token_ids[-1 - row]
    assert alone == in_batch == flipped


def test_seeded_draws_follow_the_filtered_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 1500  # one interpreted program per row: kept small for the CPU
    logits = probs.log().expand(n, -1).contiguous()
    params = [SamplingParams(temperature=1.0, top_k=3, seed=s) for s in range(n)]
    tokens = sample(logits, params, [0] * n).token_ids
    freq = torch.bincount(tokens, minlength=4).double() / n
    assert freq[3] == 0  # outside the top 3: never drawn
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0], dtype=torch.float64) / 0.95
    torch.testing.assert_close(freq, expected, rtol=0, atol=0.052)  # ~4 standard errors


def test_seeds_beyond_int64_are_keyed_by_a_hash_and_stay_reproducible() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    huge = [SamplingParams(temperature=1.0, seed=2**70 + i) for i in range(3)]
    first, again = sample(logits, huge, [4] * 3), sample(logits, huge, [4] * 3)
    assert torch.equal(first.token_ids, again.token_ids)
    alone = sample(logits[1:2], huge[1:2], [4]).token_ids[0]
    assert alone == first.token_ids[1]
