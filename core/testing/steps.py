"""Build a :class:`~kvrunner.batch.StepInput` row by row, for tests and benchmarks.

The engine builds steps as columns directly; tests read better one sequence at a
time. ``Row`` has the step's fields in its order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import attrs

from kvrunner.batch import StepInput
from kvrunner.sampling_params import SamplingParams


class Row(NamedTuple):
    """One sequence's share of a step."""

    seq_id: int
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    state_slot: int
    sample: bool
    sampling: SamplingParams
    num_output_tokens: int


def step_of(rows: Iterable[Row]) -> StepInput:
    """The step whose row ``i`` is ``rows[i]``."""
    rows = list(rows)
    return StepInput(*([list(column) for column in zip(*rows, strict=True)] or
                       [[] for _ in attrs.fields(StepInput)]))


def rows_of(step: StepInput) -> list[Row]:
    """The step one sequence at a time."""
    return [Row(*values) for values in zip(*attrs.astuple(step, recurse=False), strict=True)]
