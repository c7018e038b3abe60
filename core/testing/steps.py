"""Build a :class:`~kvrunner.engine.step_io.StepInput` row by row, for tests and benchmarks.

The engine builds steps as columns directly; tests read better one sequence at a
time. ``Row`` has the step's per-row fields in their order (every field but the
step-level ``history_init``, which comes last).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import attrs
import numpy as np

from kvrunner.engine.step_io import SamplingColumns, StepInput
from kvrunner.sampling_params import SamplingParams


class Row(NamedTuple):
    """One sequence's share of a step."""

    seq_id: int
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    state_slot: int
    sample: bool
    #: its sampling settings: a ``SamplingParams`` (:func:`step_of`), or its one-row
    #: slice of the step's columns (:func:`rows_of`)
    sampling: SamplingParams | SamplingColumns
    num_output_tokens: int
    #: the prompt tokens its chunk scores (None: the step scores no prompt)
    prompt_targets: tuple[int, ...] | None = None
    #: the first position whose routed experts it returns (-1: none)
    route_from: int = -1


def _sampling_columns(rows: Sequence[SamplingParams | SamplingColumns]) -> SamplingColumns:
    """The step's sampling columns, given each row's settings."""
    params = [r for r in rows if isinstance(r, SamplingParams)]
    if len(params) == len(rows):
        return SamplingColumns.of(params)
    parts = [r if isinstance(r, SamplingColumns) else SamplingColumns.of([r]) for r in rows]
    rules = tuple(rule for p in parts for rule in (p.rules or (None,) * len(p)))
    return SamplingColumns(*(np.concatenate(c) for c in zip(*(p.arrays() for p in parts),
                                                             strict=True)),
                           rules=rules if any(r is not None for r in rules) else None)


def step_of(rows: Iterable[Row], *,
            history_init: dict[int, tuple[int, int, tuple[int, ...]]] | None = None
            ) -> StepInput:  # fmt: skip
    """The step whose row ``i`` is ``rows[i]`` (``history_init``: the step's own, not a
    row's: ``StepInput.history_init``)."""
    rows = list(rows)
    columns: list = [list(column) for column in zip(*rows, strict=True)] or [
        [] for _ in Row._fields]
    sampling = Row._fields.index("sampling")
    columns[sampling] = _sampling_columns(columns[sampling])
    targets = Row._fields.index("prompt_targets")
    if all(t is None for t in columns[targets]):
        columns[targets] = None  # a step that scores no prompt
    else:
        columns[targets] = [() if t is None else tuple(t) for t in columns[targets]]
    if all(r < 0 for r in columns[-1]):
        columns[-1] = None  # a step that returns no route
    return StepInput(*columns, history_init=history_init)


def rows_of(step: StepInput) -> list[Row]:
    """The step one sequence at a time (each row's sampling settings a one-row slice of
    its columns)."""
    columns = list(attrs.astuple(step, recurse=False))[: len(Row._fields)]
    columns[Row._fields.index("sampling")] = [step.sampling.take([i])
                                              for i in range(step.num_seqs)]
    targets = Row._fields.index("prompt_targets")
    if columns[targets] is None:
        columns[targets] = [None] * step.num_seqs
    if columns[-1] is None:
        columns[-1] = [-1] * step.num_seqs
    return [Row(*values) for values in zip(*columns, strict=True)]
