"""``prepare_step``: the engine's chunks laid out as one flat token batch.

Checked against the per-token definitions, one token at a time: position ``p`` of a
sequence lives at ``block_table[p // block_size] * block_size + p % block_size``;
a chunk's tokens take consecutive rows; a sampling chunk samples its last row.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvrunner.engine.step_io import StepInput
from kvrunner.runner.step.step_batch import prepare_step
from kvrunner.sampling_params import SamplingParams
from kvrunner.testing.steps import Row, rows_of, step_of

GREEDY = SamplingParams(temperature=0.0)


@st.composite
def steps(draw) -> tuple[StepInput, int]:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    chunks = []
    for seq_id in range(draw(st.integers(1, 8))):
        start = draw(st.integers(0, 40))
        n = draw(st.integers(1, 12))
        needed = (start + n + block_size - 1) // block_size
        spare = draw(st.integers(0, 2))  # tables may hold more blocks than needed
        table = draw(st.lists(st.integers(0, 500), min_size=needed + spare,
                              max_size=needed + spare, unique=True))
        chunks.append(Row(
            seq_id=seq_id, token_ids=tuple(draw(st.lists(st.integers(0, 99), min_size=n,
                                                         max_size=n))),
            start_pos=start, block_table=tuple(table), state_slot=draw(st.integers(-1, 9)),
            sample=draw(st.booleans()), sampling=GREEDY, num_output_tokens=0,
        ))
    return step_of(chunks), block_size


@given(steps())
def test_every_token_lands_where_its_block_table_says(case: tuple[StepInput, int]) -> None:
    step, block_size = case
    prepared = prepare_step(step, block_size=block_size)
    batch = prepared.batch
    row = 0
    for i, c in enumerate(rows_of(step)):
        assert int(batch.cu_query_lens[i]) == row
        for k, token in enumerate(c.token_ids):
            pos = c.start_pos + k
            assert int(prepared.input_ids[row]) == token
            assert int(batch.positions[row]) == pos
            expected = c.block_table[pos // block_size] * block_size + pos % block_size
            assert int(batch.slot_mapping[row]) == expected
            row += 1
        assert int(batch.context_lens[i]) == c.start_pos + len(c.token_ids)
        assert int(batch.state_slots[i]) == c.state_slot
    assert batch.num_tokens == row == int(batch.cu_query_lens[-1])
    last_rows = [int(batch.cu_query_lens[i + 1]) - 1 for i, c in enumerate(rows_of(step))
                 if c.sample]
    assert prepared.sample_rows == last_rows


@given(steps())
def test_the_table_array_is_every_table_zero_padded(case: tuple[StepInput, int]) -> None:
    step, block_size = case
    array = prepare_step(step, block_size=block_size).batch.block_table_array
    longest = max(len(c.block_table) for c in rows_of(step))
    assert tuple(array.shape) == (len(rows_of(step)), longest)
    for i, c in enumerate(rows_of(step)):
        n = len(c.block_table)
        assert array[i, :n].tolist() == list(c.block_table)
        assert array[i, n:].tolist() == [0] * (longest - n)


@given(steps())
def test_a_rank_prepares_an_unpickled_step_exactly_as_the_original(
    case: tuple[StepInput, int],
) -> None:
    step, block_size = case
    back = pickle.loads(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))
    prepared, expected = (prepare_step(s, block_size=block_size) for s in (back, step))
    assert torch.equal(prepared.batch.slot_mapping, expected.batch.slot_mapping)
    assert prepared.sample_rows == expected.sample_rows
    assert (back.num_seqs, back.num_tokens, back.is_decode) == (
        step.num_seqs, step.num_tokens, step.is_decode
    )
    assert back == step


def test_a_block_table_too_short_for_its_tokens_is_refused_naming_the_sequence() -> None:
    chunk = Row(seq_id=7, token_ids=(1, 2, 3), start_pos=14, block_table=(4,),
                state_slot=-1, sample=True, sampling=GREEDY, num_output_tokens=0)
    with pytest.raises(ValueError, match="sequence 7: block table holds 1 blocks, 2 needed"):
        prepare_step(step_of([chunk]), block_size=16)
