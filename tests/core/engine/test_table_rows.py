"""TableRows: the block manager's persistent block-table array.

Checked against a plain dict of lists through random acquire / extend / release
sequences, past its initial size in both directions: every held row reads back its
table then zeros, every free row is all zeros, and a gather is exactly the
zero-padded ``BlockTables`` of the tables it names.
"""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from kvrunner.engine.step_io import BlockTables
from kvrunner.engine.table_rows import TableRows

blocks = st.lists(st.integers(0, 10_000), max_size=40)
ops = st.lists(st.tuples(st.sampled_from(["acquire", "extend", "release"]), blocks,
                         st.integers(0, 1_000)), max_size=120)  # fmt: skip


def check(rows: TableRows, model: dict[int, list[int]]) -> None:
    assert rows.num_rows_held == len(model)
    for row in range(len(rows.array)):
        table = model.get(row, [])
        assert rows.table(row) == table
        assert int(rows.lens[row]) == len(table)
        assert not rows.array[row, len(table):].any()


@given(ops, st.randoms(use_true_random=False))
def test_rows_always_hold_exactly_their_tables_then_zeros(ops: list, rng: random.Random) -> None:
    rows = TableRows()
    model: dict[int, list[int]] = {}
    for op, new, pick in ops:
        if op == "acquire" or not model:
            row = rows.acquire(new)
            assert row not in model
            model[row] = list(new)
        else:
            row = sorted(model)[pick % len(model)]
            if op == "extend":
                rows.extend(row, new)
                model[row] += new
            else:
                rows.release(row)
                del model[row]
        check(rows, model)
        picked = [rng.choice(sorted(model)) for _ in range(rng.randint(0, 6))] if model else []
        gathered = rows.gather(picked)
        assert gathered == BlockTables.from_rows([model[r] for r in picked])
        assert gathered.array.shape[1] == max([len(model[r]) for r in picked] + [1])


def test_it_grows_past_its_initial_rows_and_width() -> None:
    rows = TableRows()
    model = {rows.acquire(list(range(i, i + 3 * i))): list(range(i, i + 3 * i))
             for i in range(200)}  # fmt: skip
    check(rows, model)
    gathered = rows.gather(sorted(model, reverse=True))
    assert list(gathered) == [tuple(model[r]) for r in sorted(model, reverse=True)]


def test_a_gather_is_a_copy_the_step_keeps() -> None:
    rows = TableRows()
    row = rows.acquire([5, 6])
    step_tables = rows.gather([row])
    rows.extend(row, [7])
    rows.release(row)
    assert list(step_tables) == [(5, 6)]
