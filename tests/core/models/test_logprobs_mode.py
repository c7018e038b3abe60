"""What each ``logprobs_mode`` reports, against a plain-torch reference.

For any logits (ties and masked ``-inf`` tokens included) and any temperature, top-k,
top-p, ``min_p`` and logit bias: every token's reported value (the whole top-logprobs
list), the sampled token's value and the kept mass equal the reference's
(``logprobs_reference.py``); the sampled token is always one the truncation kept; and
the kept mass is exactly what separates the processed logprob from a full-vocabulary
one at the same temperature.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st
from logprobs_reference import adjusted, reference

from kvrunner.config import LOGPROBS_MODES, ConfigError, EngineConfig
from kvrunner.engine.step_io import SamplingColumns
from kvrunner.layers.logit_processing import adjusted_logits
from kvrunner.layers.sampler import Sampler, sample, with_logprobs
from kvrunner.sampling_params import SamplingParams

# Logit values partly from a tiny set (ties) and partly -inf (masked tokens).
logit_value = st.one_of(
    st.floats(-20, 20, allow_nan=False, width=32),
    st.sampled_from([0.0, 1.0, -3.0]),
    st.just(-math.inf),
)


@st.composite
def batches(draw, *, temperature=None):
    """``(logits [N, V], params)``: every row asks for every token's logprob and its kept
    mass; at least one finite logit a row (an all -inf row samples nothing)."""
    rows = draw(st.integers(1, 4))
    vocab = draw(st.integers(2, 16))
    values = draw(st.lists(logit_value, min_size=rows * vocab, max_size=rows * vocab))
    logits = torch.tensor(values, dtype=torch.float32).view(rows, vocab)
    for r in range(rows):
        if torch.isinf(logits[r]).all():
            logits[r, draw(st.integers(0, vocab - 1))] = draw(st.sampled_from([0.0, 2.5]))
    params = []
    for _ in range(rows):
        bias = draw(
            st.one_of(
                st.just({}),
                st.dictionaries(st.integers(0, vocab - 1), st.floats(-5, 5), max_size=3),
            )
        )
        params.append(
            SamplingParams(
                temperature=draw(st.one_of(st.just(0.0), st.floats(0.05, 3.0)))
                if temperature is None
                else temperature,
                top_k=draw(st.integers(0, vocab + 1)),
                top_p=draw(st.one_of(st.just(1.0), st.floats(0.05, 1.0))),
                min_p=draw(st.one_of(st.just(0.0), st.floats(0.01, 0.99))),
                logit_bias=bias,
                seed=draw(st.integers(0, 2**40)),
                logprobs=vocab,
                return_kept_mass=True,
            )
        )
    return logits, params


def reported(out, row: int, vocab: int) -> torch.Tensor:
    """Row ``row``'s reported value of every token, from its full top list."""
    full = torch.empty(vocab, dtype=torch.float64)
    full[out.top_ids[row, :vocab]] = out.top_logprobs[row, :vocab].to(torch.float64)
    return full


def assert_values_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to float32 rounding, and -inf exactly where the reference's is."""
    assert torch.equal(torch.isinf(got), torch.isinf(want)), (got, want)
    finite = ~torch.isinf(want)
    assert torch.allclose(got[finite], want[finite], rtol=1e-5, atol=1e-4), (got, want)


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
@given(batch=batches())
@example(
    batch=(
        torch.tensor([[1.0, 1.0, 1.0, -math.inf]]),  # a three-way tie, top-k 2
        [SamplingParams(temperature=0.5, top_k=2, logprobs=4, return_kept_mass=True)],
    )
)
def test_each_mode_reports_the_references_values(mode, batch) -> None:
    """Every token's value (the whole top list) and the sampled token's equal the
    reference's, as do the kept masses."""
    logits, params = batch
    vocab = logits.shape[1]
    refs = [reference(logits[r], p) for r, p in enumerate(params)]
    assume(all(ref.margin > 1e-4 for ref in refs))  # no decision at float32's rounding
    out = sample(logits, params, [0] * len(params), logprobs_mode=mode)
    for r, ref in enumerate(refs):
        want = ref.values[mode]
        assert_values_equal(reported(out, r, vocab), want)
        token = int(out.token_ids[r])
        assert out.logprobs[r].item() == pytest.approx(want[token].item(), rel=1e-5, abs=1e-4)
        assert out.kept_mass[r].item() == pytest.approx(ref.kept_mass, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits"])
@given(batch=batches())
def test_tokens_chosen_elsewhere_get_the_same_values(mode, batch) -> None:
    """``with_logprobs`` on tokens a decode graph chose (no truncated logits kept from
    a draw: it truncates itself) reports what the sampler reports for them."""
    logits, params = batch
    refs = [reference(logits[r], p) for r, p in enumerate(params)]
    assume(all(ref.margin > 1e-4 for ref in refs))
    drawn = sample(logits, params, [0] * len(params), logprobs_mode=mode)
    columns = SamplingColumns.of(params)
    adjusted_rows = None if columns.rules is None else adjusted_logits(
        logits, columns.rules, np.zeros(len(params), np.int64), None)  # fmt: skip
    again = with_logprobs(logits, drawn.token_ids, drawn.row_max, columns, mode=mode,
                          adjusted=adjusted_rows)  # fmt: skip
    assert torch.equal(again.logprobs, drawn.logprobs)
    assert torch.equal(again.kept_mass, drawn.kept_mass)
    for r, ref in enumerate(refs):
        assert_values_equal(reported(again, r, logits.shape[1]), ref.values[mode])


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
@given(batch=batches())
def test_a_rows_values_do_not_depend_on_the_rows_beside_it(mode, batch) -> None:
    """Bit for bit, alone or in the batch (what deterministic mode needs of them)."""
    logits, params = batch
    together = sample(logits, params, [0] * len(params), keys=range(len(params)),
                      logprobs_mode=mode)  # fmt: skip
    for r, p in enumerate(params):
        alone = sample(logits[r : r + 1], [p], [0], keys=[r], logprobs_mode=mode)
        assert torch.equal(alone.token_ids, together.token_ids[r : r + 1])
        assert torch.equal(alone.logprobs, together.logprobs[r : r + 1])
        assert torch.equal(alone.top_logprobs, together.top_logprobs[r : r + 1])
        assert torch.equal(alone.kept_mass, together.kept_mass[r : r + 1])


@given(batch=batches())
def test_the_sampled_token_is_always_one_the_truncation_kept(batch) -> None:
    logits, params = batch
    refs = [reference(logits[r], p) for r, p in enumerate(params)]
    assume(all(ref.margin > 1e-4 for ref in refs))
    out = sample(logits, params, [0] * len(params), logprobs_mode="processed_logprobs")
    for r, ref in enumerate(refs):
        assert ref.kept[int(out.token_ids[r])]
        assert math.isfinite(out.logprobs[r].item())


@given(batch=batches(temperature=0.7))
def test_the_kept_mass_is_what_separates_processed_from_full_vocabulary(batch) -> None:
    """processed_logprob = log softmax(adjusted / T)[token] - log(kept_mass): what a
    trainer scoring the full vocabulary at the request's temperature adds back."""
    logits, params = batch
    refs = [reference(logits[r], p) for r, p in enumerate(params)]
    assume(all(ref.margin > 1e-4 for ref in refs))
    out = sample(logits, params, [0] * len(params), logprobs_mode="processed_logprobs")
    for r, p in enumerate(params):
        token = int(out.token_ids[r])
        full = torch.log_softmax(adjusted(logits[r], p) / p.temperature, dim=0)[token].item()
        mass = out.kept_mass[r].item()
        assert 0.0 < mass <= 1.0 + 1e-6
        assert out.logprobs[r].item() == pytest.approx(full - math.log(mass), abs=1e-4)


def test_a_row_that_asks_for_nothing_gets_nothing() -> None:
    """No logprobs and no kept mass unless a row asks, in any mode."""
    logits = torch.randn(2, 10)
    for mode in LOGPROBS_MODES:
        out = sample(
            logits,
            [SamplingParams(temperature=0.5, top_k=3, seed=1)] * 2,
            [0, 0],
            logprobs_mode=mode,
        )
        assert out.logprobs is None and out.kept_mass is None


def test_a_greedy_row_reports_the_adjusted_logits_with_nothing_kept_out() -> None:
    """top-k / top-p / min_p do not touch a greedy pick, so they do not touch its
    processed logprobs either; the logit bias does."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    params = SamplingParams(
        temperature=0.0, top_k=1, top_p=0.1, logit_bias={3: 4.0}, logprobs=4, return_kept_mass=True
    )
    out = sample(logits, [params], [0], logprobs_mode="processed_logprobs")
    want = torch.log_softmax(torch.tensor([2.0, 1.0, 0.5, 3.0]), dim=0)
    assert int(out.token_ids[0]) == 3
    assert torch.allclose(reported(out, 0, 4).float(), want)
    assert out.kept_mass[0].item() == 1.0


def test_an_untruncated_row_keeps_all_its_mass() -> None:
    logits = torch.randn(3, 50)
    out = sample(
        logits,
        [SamplingParams(temperature=t, seed=1, return_kept_mass=True) for t in (0.3, 1.0, 2.0)],
        [0, 0, 0],
    )
    assert out.kept_mass.tolist() == [1.0, 1.0, 1.0]


def test_a_bad_mode_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="logprobs_mode must be one of raw_logprobs"):
        EngineConfig.load(logprobs_mode="processed")
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        Sampler(0, "logits")
