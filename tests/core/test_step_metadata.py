"""The core's shared step metadata: built once, padded rows read nothing, and a
micro-batch is a slice equal to the metadata of the sub-step built on its own."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from kvrunner.plugin_api import StepMetadata
from kvrunner.runner.step.step_batch import prepare_step
from kvrunner.runner.step.step_metadata import StepMetadataBuilder
from kvrunner.sampling_params import SamplingParams
from kvrunner.testing.steps import Row, step_of

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0)


def _builder() -> StepMetadataBuilder:
    return StepMetadataBuilder(max_batch=8, max_tokens=64, max_blocks_per_seq=8,
                               device=torch.device("cpu"))


@st.composite
def steps(draw) -> tuple[list[Row], int | None]:
    decode = draw(st.booleans())
    rows = []
    for seq_id in range(draw(st.integers(1, 5))):
        start = draw(st.integers(1 if decode else 0, 12))
        n = 1 if decode else draw(st.integers(1, 6))
        blocks = draw(st.lists(st.integers(0, 30), min_size=-(-(start + n) // BLOCK),
                               max_size=-(-(start + n) // BLOCK)))
        rows.append(Row(seq_id, (1,) * n, start, tuple(blocks), seq_id, True, GREEDY, 0))
    padded = len(rows) + draw(st.integers(0, 3)) if decode else None
    return rows, padded


def _fill(rows: list[Row], padded: int | None) -> StepMetadata:
    batch = prepare_step(step_of(rows), block_size=BLOCK, num_padded_seqs=padded).batch
    return _builder().fill(batch)


def _same(a: StepMetadata, b: StepMetadata) -> None:
    for name in ("query_start_loc", "context_lens", "block_tables", "positions"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("num_seqs", "num_padded_seqs", "num_tokens", "num_padded_tokens",
                 "max_query_len", "max_context_len", "is_decode"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("query_lens", "cu_query_lens", "slot_mapping", "state_slots", "positions"):
        assert torch.equal(getattr(a.host, name), getattr(b.host, name)), name


@given(steps(), st.data())
def test_a_micro_batch_equals_the_sub_step_built_on_its_own(case, data) -> None:
    rows, padded = case
    whole = _fill(rows, padded)
    total = whole.num_padded_seqs
    first = data.draw(st.integers(0, total - 1))
    end = data.draw(st.integers(first + 1, total))
    real = rows[first:end]
    if not real:  # an all-padded range: nothing real to build on its own
        part = whole.micro_batch(first, end)
        assert part.num_seqs == part.num_tokens == 0
        assert part.context_lens.eq(0).all() and part.query_start_loc.eq(0).all()
        return
    sub_padded = end - first if padded is not None else None
    _same(whole.micro_batch(first, end), _fill(real, sub_padded))


@given(steps())
def test_padded_rows_read_nothing_and_sit_at_position_zero(case) -> None:
    rows, padded = case
    step = _fill(rows, padded)
    n = step.num_seqs
    assert step.context_lens[n:].eq(0).all()
    assert step.query_start_loc[n:].eq(step.num_tokens).all()
    assert step.block_tables[n:].eq(0).all()
    assert step.positions[step.num_tokens :].eq(0).all()
    assert step.positions.shape[0] == step.num_padded_tokens


def test_the_capture_step_reads_one_key_at_block_zero_and_writes_nothing() -> None:
    step = _builder().fill_capture(3)
    assert step.is_capture and step.is_decode
    assert step.context_lens.tolist() == [1, 1, 1]
    assert step.query_start_loc.tolist() == [0, 1, 2, 3]
    assert step.block_tables.eq(0).all() and step.positions.eq(0).all()
    assert step.host.slot_mapping.eq(-1).all() and step.host.state_slots.eq(-1).all()
