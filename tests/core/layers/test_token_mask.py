"""A step's token masks: packed as xgrammar packs them, applied to exactly the masked rows
(xgrammar's own ``apply_token_bitmask_inplace`` is the oracle), renumbered with the
sampling columns, and crossing to the runner intact."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrunner.engine.step_io import SamplingColumns
from kvrunner.engine.token_masks import TokenMasks, mask_width
from kvrunner.layers.token_mask import masked_logits
from kvrunner.sampling_params import SamplingParams

xgr = pytest.importorskip("xgrammar")


@st.composite
def masked_batches(draw, *, words_whole: bool = False) -> tuple[torch.Tensor, TokenMasks]:
    n = draw(st.integers(1, 6))
    vocab = 32 * draw(st.integers(1, 5)) if words_whole else draw(st.integers(1, 130))
    rows = sorted(draw(st.sets(st.integers(0, n - 1), min_size=1)))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    bits = rng.integers(-(2**31), 2**31, size=(len(rows), mask_width(vocab)), dtype=np.int64)
    logits = torch.from_numpy(rng.standard_normal((n, vocab)).astype(np.float32))
    return logits, TokenMasks(np.array(rows, np.int64), bits.astype(np.int32))


@settings(max_examples=60, deadline=None)
@given(batch=masked_batches())
def test_masked_logits_forbid_exactly_the_tokens_whose_bit_is_clear(batch) -> None:
    logits, masks = batch
    before = logits.clone()
    got = masked_logits(logits, masks)
    assert torch.equal(logits, before)  # a copy: a graph's logits buffer stays as it was
    words = {int(r): [int(w) & 0xFFFFFFFF for w in masks.bits[k]]
             for k, r in enumerate(masks.rows)}  # fmt: skip
    for row in range(logits.shape[0]):
        for token in range(logits.shape[1]):
            allowed = row not in words or (words[row][token // 32] >> (token % 32)) & 1 == 1
            assert masks.allows(row, token) == allowed
            assert got[row, token] == (logits[row, token] if allowed else float("-inf"))


@settings(max_examples=30, deadline=None)
@given(batch=masked_batches(words_whole=True))
def test_masked_logits_match_xgrammars_own_application(batch) -> None:
    # (whole words only: xgrammar's CPU kernel writes past a vocabulary that ends inside
    # a word, so it is no oracle there)
    logits, masks = batch
    want = logits.clone()
    full = torch.full((len(logits), masks.bits.shape[1]), -1, dtype=torch.int32)
    full[torch.from_numpy(masks.rows)] = torch.from_numpy(masks.bits)
    xgr.apply_token_bitmask_inplace(want, full)
    assert torch.equal(masked_logits(logits, masks), want)


def test_masks_packed_for_another_vocabulary_are_refused() -> None:
    masks = TokenMasks(np.array([0]), np.full((1, 2), -1, np.int32))
    with pytest.raises(ValueError, match="2 words for logits of 100 tokens"):
        masked_logits(torch.zeros(1, 100), masks)


def test_take_renumbers_the_masked_rows_as_the_columns_are_taken() -> None:
    bits = np.arange(6, dtype=np.int32).reshape(3, 2)
    columns = SamplingColumns.of([SamplingParams()] * 6)
    columns = SamplingColumns(*columns.arrays(), masks=TokenMasks(np.array([1, 3, 4]), bits))
    taken = columns.take([4, 0, 1, 5])
    assert taken.masks == TokenMasks(np.array([0, 2]), bits[[2, 0]])
    assert columns.take([0, 2, 5]).masks is None
    assert pickle.loads(pickle.dumps(columns)) == columns
    assert columns.adjusted and not SamplingColumns.of([SamplingParams()]).adjusted


def test_mask_rows_must_ascend_and_fit_the_columns() -> None:
    with pytest.raises(ValueError, match="ascend"):
        TokenMasks(np.array([2, 1]), np.zeros((2, 1), np.int32))
    with pytest.raises(ValueError, match="mask for row 3"):
        SamplingColumns(*SamplingColumns.of([SamplingParams()] * 2).arrays(),
                        masks=TokenMasks(np.array([3]), np.zeros((1, 1), np.int32)))
