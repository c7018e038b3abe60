"""Sampler properties: greedy, top-k, top-p, per-request seeds, logprobs, distribution."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from kvrunner.engine.step_io import unpack_sampled
from kvrunner.layers.sampler import Sampler, sample
from kvrunner.sampling_params import SamplingParams
from kvrunner.testing.steps import Row, step_of

# Logit values drawn partly from a tiny set so ties (the awkward case) are common.
logit_value = st.one_of(
    st.floats(-20, 20, allow_nan=False, width=32), st.sampled_from([0.0, 1.0, -3.0])
)


@st.composite
def batches(draw, *, min_rows: int = 1, max_rows: int = 5, **fixed):
    """``(logits [N, V], params, num_generated)`` with random per-row settings;
    ``fixed`` pins SamplingParams fields for every row."""
    rows = draw(st.integers(min_rows, max_rows))
    vocab = draw(st.integers(2, 24))
    values = draw(st.lists(logit_value, min_size=rows * vocab, max_size=rows * vocab))
    logits = torch.tensor(values, dtype=torch.float32).view(rows, vocab)
    params = []
    for _ in range(rows):
        fields = dict(
            temperature=draw(st.one_of(st.just(0.0), st.floats(0.05, 3.0))),
            top_k=draw(st.integers(0, vocab + 2)),
            top_p=draw(st.floats(0.05, 1.0)),
            seed=draw(st.one_of(st.none(), st.integers(0, 2**40))),
            logprobs=draw(st.one_of(st.none(), st.integers(0, vocab + 1))),
        )
        fields.update(fixed)
        params.append(SamplingParams(**fields))
    counts = draw(st.lists(st.integers(0, 500), min_size=rows, max_size=rows))
    return logits, params, counts


def chosen_logit(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logits.gather(1, tokens[:, None]).squeeze(1)


@given(batches(temperature=0.0))
def test_greedy_is_argmax_whatever_the_filters(batch) -> None:
    logits, params, counts = batch
    assert torch.equal(sample(logits, params, counts).token_ids, logits.argmax(dim=-1))


#: a subnormal logit the temperature halves to zero: the scaled row ties, the raw one
#: does not (found by the property in CI)
SUBNORMAL = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 1.4013e-45]])


@given(batches(), st.floats(0.05, 5.0))
@example((SUBNORMAL, [SamplingParams(temperature=0.0)] * 3, [0, 0, 0]), 2.0)
def test_top_k_one_is_greedy_at_any_temperature(batch, temperature: float) -> None:
    logits, params, counts = batch
    params = [SamplingParams(temperature=temperature, top_k=1, top_p=p.top_p, seed=p.seed)
              for p in params]
    tokens = sample(logits, params, counts).token_ids
    assert torch.equal(chosen_logit(logits, tokens), logits.max(dim=-1).values)


@given(batches(), st.floats(0.05, 5.0))
def test_tiny_top_p_is_greedy(batch, temperature: float) -> None:
    logits, params, counts = batch
    params = [SamplingParams(temperature=temperature, top_p=1e-6, seed=p.seed) for p in params]
    tokens = sample(logits, params, counts).token_ids
    assert torch.equal(chosen_logit(logits, tokens), logits.max(dim=-1).values)


@given(batches())
def test_sampled_token_is_in_top_k_set_and_top_p_nucleus(batch) -> None:
    logits, params, counts = batch
    tokens = sample(logits, params, counts).token_ids
    vocab = logits.shape[1]
    for row, p in enumerate(params):
        token = int(tokens[row])
        if p.greedy:
            continue
        scaled = logits[row].double() / p.temperature
        k = p.top_k if 0 < p.top_k < vocab else vocab
        kth = scaled.sort(descending=True).values[k - 1]
        assert scaled[token] >= kth
        # Nucleus over the top-k survivors: the mass strictly more likely than the
        # chosen token must not already reach top_p.
        kept = scaled.masked_fill(scaled < kth, -math.inf)
        probs = kept.softmax(dim=-1)
        assert probs[probs > probs[token]].sum() < p.top_p + 1e-5


@given(batches(min_rows=2), st.integers(0, 2**40), st.integers(0, 500), st.data())
def test_seeded_row_does_not_depend_on_its_batch(batch, seed: int, count: int, data) -> None:
    logits, params, counts = batch
    row = data.draw(st.integers(0, len(params) - 1))
    mine = SamplingParams(temperature=1.0, top_k=params[row].top_k, top_p=params[row].top_p,
                          seed=seed)
    alone = sample(logits[row : row + 1], [mine], [count]).token_ids[0]
    params[row], counts[row] = mine, count
    in_batch = sample(logits, params, counts).token_ids[row]
    flipped = sample(logits.flip(0), params[::-1], counts[::-1]).token_ids[-1 - row]
    assert alone == in_batch == flipped


@given(batches(), st.sampled_from([torch.bfloat16, torch.float16]), st.integers(0, 2**31))
def test_half_precision_logits_sample_as_their_float32_widening(batch, dtype, seed) -> None:
    """The sampler reads 16-bit logits (a decode step's, unwidened) exactly as the
    float32 tensor they widen to: the same tokens, logprobs, top logprobs and row
    maxima, with the same generator state for unseeded rows."""
    logits, params, counts = batch
    half = logits.to(dtype)
    outs = [sample(x, params, counts, generator=torch.Generator().manual_seed(seed))
            for x in (half, half.float())]
    got, want = outs
    assert torch.equal(got.token_ids, want.token_ids)
    assert torch.equal(got.row_max.float(), want.row_max)
    for name in ("logprobs", "top_ids", "top_logprobs"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name


def test_seeded_draws_change_with_the_generated_count() -> None:
    logits = torch.zeros(1, 16)
    p = [SamplingParams(seed=7)]
    draws = {int(sample(logits, p, [n]).token_ids[0]) for n in range(30)}
    assert len(draws) > 4  # a count ignored by the seed would give one token


@given(batches())
def test_logprobs_are_raw_log_softmax(batch) -> None:
    logits, params, counts = batch
    out = sample(logits, params, counts)
    if all(p.logprobs is None for p in params):
        assert out.logprobs is None and out.top_ids is None  # nobody asked: not computed
        return
    reference = torch.log_softmax(logits.double(), dim=-1)
    expected = reference.gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs.double(), expected, rtol=1e-5, atol=1e-5)
    for row, p in enumerate(params):
        top = out.top_logprobs_dict(row)
        n = min(p.logprobs or 0, logits.shape[1])
        if n == 0:
            assert top is None
            continue
        assert len(top) == n
        largest = reference[row].sort(descending=True).values[:n]
        got = torch.tensor(sorted(top.values(), reverse=True), dtype=torch.float64)
        torch.testing.assert_close(got, largest, rtol=1e-5, atol=1e-5)
        for token, value in top.items():
            assert math.isclose(value, float(reference[row, token]), rel_tol=1e-5, abs_tol=1e-5)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(temperature=1.0), [0.5, 0.3, 0.15, 0.05]),
        (SamplingParams(temperature=1.0, top_k=2), [0.625, 0.375, 0.0, 0.0]),
        (SamplingParams(temperature=1.0, top_p=0.9), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        # temperature 0.5 squares the probabilities: p**2 / sum(p**2), sum = 0.365
        (SamplingParams(temperature=0.5), [0.25 / 0.365, 0.09 / 0.365, 0.0225 / 0.365,
                                           0.0025 / 0.365]),
    ],
    ids=["plain", "top_k", "top_p", "temperature"],
)
def test_draws_follow_the_filtered_distribution(params: SamplingParams, expected) -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    logits = probs.log().expand(n, -1).contiguous()
    gen = torch.Generator().manual_seed(1234)
    tokens = sample(logits, [params] * n, [0] * n, generator=gen).token_ids
    freq = torch.bincount(tokens, minlength=4).double() / n
    # ~4 standard errors of a 20k-draw frequency
    expected = torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(freq, expected, rtol=0, atol=0.015)


def test_sampler_with_the_same_seed_repeats_unseeded_draws() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0)] * 8
    first = [Sampler(seed=3)(logits, params, [0] * 8).token_ids for _ in range(2)]
    assert torch.equal(first[0], first[1])
    sampler = Sampler(seed=3)
    steps = [sampler(logits, params, [0] * 8).token_ids for _ in range(2)]
    assert torch.equal(steps[0], first[0]) and not torch.equal(steps[0], steps[1])


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="2 logit rows"):
        sample(torch.zeros(2, 4), [SamplingParams()], [0])


@pytest.mark.gpu
def test_seeded_and_unseeded_sampling_on_cuda() -> None:
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0)).cuda()
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=s, logprobs=3)
              for s in (None, 1, 2, None, 3, 0)]
    counts = [0, 5, 9, 0, 2, 1]
    out = Sampler(seed=0)(logits, params, counts)
    assert out.token_ids.device.type == "cuda" and out.token_ids.dtype == torch.long
    for row in (1, 2, 4, 5):
        alone = sample(logits[row : row + 1], [params[row]], [counts[row]]).token_ids[0]
        assert alone == out.token_ids[row]
    assert len(out.top_logprobs_dict(0)) == 3
    again = Sampler(seed=0)(logits, params, counts)
    assert torch.equal(again.token_ids, out.token_ids)


def test_a_step_samples_its_sampling_chunks_with_logprobs_only_where_asked() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    chunks = [
        Row(seq_id=10 + i, token_ids=(1,), start_pos=4, block_table=(0,), state_slot=i,
                 sample=True, sampling=sp, num_output_tokens=n)
        for i, (sp, n) in enumerate([
            (SamplingParams(temperature=0.0), 0),
            (SamplingParams(temperature=0.0, logprobs=0), 3),
            (SamplingParams(temperature=1.0, seed=5, logprobs=2), 7),
        ])
    ]
    # A chunk still mid-prefill samples nothing and has no logits row.
    prefilling = Row(seq_id=99, token_ids=(1, 2), start_pos=0, block_table=(1,),
                          state_slot=5, sample=False, sampling=SamplingParams(),
                          num_output_tokens=0)
    step = step_of([chunks[0], prefilling, chunks[1], chunks[2]])
    got = unpack_sampled(Sampler(seed=0).sample_step_rows(logits, step).packed())
    reference = torch.log_softmax(logits, dim=-1)
    assert [t.seq_id for t in got] == [10, 11, 12]
    assert [t.token_id for t in got[:2]] == logits[:2].argmax(dim=-1).tolist()
    seeded = sample(logits[2:], [chunks[2].sampling], [7]).token_ids[0]
    assert got[2].token_id == int(seeded)
    assert got[0].logprob is None and got[0].top_logprobs is None
    assert got[1].top_logprobs is None
    assert math.isclose(got[1].logprob, float(reference[1, got[1].token_id]), rel_tol=1e-6)
    assert len(got[2].top_logprobs) == 2
    assert max(got[2].top_logprobs.values()) == pytest.approx(float(reference[2].max()))


@given(batches(), st.data())
def test_row_max_is_nan_exactly_in_rows_holding_a_nan(batch, data) -> None:
    logits, params, counts = batch
    rows, vocab = logits.shape
    for row in data.draw(st.sets(st.integers(0, rows - 1))):
        logits[row, data.draw(st.integers(0, vocab - 1))] = math.nan
    out = sample(logits, params, counts)
    assert torch.equal(out.row_max.isnan(), logits.isnan().any(dim=-1))
