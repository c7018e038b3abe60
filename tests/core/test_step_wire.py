"""What crosses to rank processes: a step and its sampled tokens, as columns.

Both directions are on the decode path of every tensor-parallel step, so they
travel as one list or array per field. The properties: the round trip is exact, and the
pickled step holds no per-sequence objects.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrunner.engine.step_io import (
    BlockTables,
    SampledToken,
    SampledTokens,
    StepInput,
    no_samples,
    unpack_sampled,
)
from kvrunner.sampling_params import SamplingParams
from kvrunner.testing.steps import Row, rows_of, step_of

small = st.integers(0, 10_000)
params = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 64),
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    top_p=st.sampled_from([1.0, 0.9]),
    seed=st.none() | small,
    logprobs=st.none() | st.integers(0, 4),
)


@st.composite
def steps(draw) -> StepInput:
    shared = draw(params)  # one request's params shared by many chunks, as in generate()
    chunks = []
    for seq_id in draw(st.lists(small, unique=True, max_size=12)):
        chunks.append(Row(
            seq_id=seq_id,
            token_ids=tuple(draw(st.lists(small, min_size=1, max_size=6))),
            start_pos=draw(small),
            block_table=tuple(draw(st.lists(small, max_size=8))),
            state_slot=draw(st.integers(-1, 300)),
            sample=draw(st.booleans()),
            sampling=draw(st.just(shared) | params),
            num_output_tokens=draw(small),
        ))
    return step_of(chunks)


@given(steps())
def test_a_step_survives_the_pipe_exactly(step: StepInput) -> None:
    back = pickle.loads(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == step
    assert rows_of(back) == rows_of(step)


@given(steps())
def test_a_pickled_step_is_columns_not_one_object_per_sequence(step: StepInput) -> None:
    payload = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
    assert b"Row" not in payload  # no object per sequence, only lists
    assert b"SamplingParams" not in payload  # the sampling settings are arrays


def test_sampling_settings_cross_as_seven_arrays_whatever_the_rows() -> None:
    """Every row's settings, each request's own (as ``generate`` makes them), travel
    as the sampling columns' arrays: no ``SamplingParams`` on the wire, and 8 bytes
    a row per column (1 for ``has_seed``)."""
    rows = 200
    step = step_of(
        Row(seq_id=i, token_ids=(1,), start_pos=4, block_table=(i,), state_slot=-1,
            sample=True, sampling=SamplingParams(max_tokens=8, temperature=0.7, seed=i,
                                                 logprobs=i % 3),
            num_output_tokens=0)
        for i in range(rows)
    )
    payload = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
    assert b"SamplingParams" not in payload
    assert pickle.loads(payload) == step
    columns = pickle.dumps(step.sampling, protocol=pickle.HIGHEST_PROTOCOL)
    assert len(columns) <= rows * (6 * 8 + 1) + 1024


sampled_rows = st.lists(
    st.tuples(small, small, st.none() | st.floats(-50, 0),
              st.none() | st.dictionaries(small, st.floats(-50, 0), max_size=4)),
    max_size=12,
)


@given(sampled_rows)
def test_sampled_columns_cross_the_pipe_and_become_one_token_per_row(rows: list) -> None:
    packed = tuple(list(column) for column in zip(*rows, strict=True)) or no_samples()
    payload = pickle.dumps(packed, protocol=pickle.HIGHEST_PROTOCOL)
    assert b"SampledToken" not in payload
    tokens = unpack_sampled(pickle.loads(payload))
    assert tokens == [
        SampledToken(seq_id=s, token_id=t, logprob=lp, top_logprobs=top)
        for s, t, lp, top in rows
    ]


def test_the_row_helper_follows_the_step_fields_in_order() -> None:
    import attrs

    # every field but the last, the step's own history_init, is one per row
    assert list(Row._fields) + ["history_init"] == [f.name for f in attrs.fields(StepInput)]


tables = st.lists(st.lists(small, max_size=8), max_size=12)


@given(tables)
def test_block_tables_are_one_zero_padded_array_that_reads_back_as_the_tables(rows) -> None:
    bt = BlockTables.from_rows(rows)
    assert list(bt) == [tuple(r) for r in rows] and len(bt) == len(rows)
    assert bt == rows and bt == BlockTables.from_rows(tuple(r) for r in rows)
    width = max([len(r) for r in rows] + [1])
    assert bt.array.shape == (len(rows), width) and bt.array.dtype == np.int32
    for i, r in enumerate(rows):
        assert bt[i] == tuple(r) and not bt.array[i, len(r):].any()
    back = pickle.loads(pickle.dumps(bt, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == bt and back.array.flags.writeable


def test_block_tables_refuse_an_array_of_the_wrong_shape() -> None:
    with pytest.raises(ValueError, match=r"shape \(2, 3\)"):
        BlockTables(np.zeros((2, 2), np.int32), np.array([3, 1]))


@given(sampled_rows)
def test_sampled_columns_read_back_as_their_tokens(rows: list) -> None:
    tokens = [SampledToken(seq_id=s, token_id=t, logprob=lp, top_logprobs=top)
              for s, t, lp, top in rows]  # fmt: skip
    columns = SampledTokens.of(tokens)
    assert columns == tokens and list(columns) == tokens and len(columns) == len(tokens)
    assert [columns[i] for i in range(len(tokens))] == tokens
    assert SampledTokens.of(columns) is columns
    assert pickle.loads(pickle.dumps(columns)) == columns


def test_sampled_columns_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        SampledTokens([1, 2], [3], [None], [None])
