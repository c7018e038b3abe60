"""The scheduler's decode batch is its row loops, step for step.

``schedule()`` derives a steady decode step from the last one's columns and
``update()`` applies it from them (``decode_batch.py``); with ``use_columns`` off
the row-by-row loops that specify them plan and apply every step. Over random
workloads (chunked prefill, prefix hits, state slots, stop tokens and EOS, aborts,
a pool tight enough to preempt, synchronous and asynchronous steps) both must hand
the runner the very same steps, finish the same requests on the same step with the
same reasons, and leave the block manager in the same state.
"""

from __future__ import annotations

import pytest
from engine_sim import Workload, check_block_accounting, reference_outputs
from hypothesis import given
from hypothesis import strategies as st
from test_async_steps import Case, cases, engine_for

from kvrunner.config import SchedulerConfig
from kvrunner.engine.scheduler import Scheduler


def trace(case: Case, aborts: dict[int, int], *, use_columns: bool, async_scheduling: bool):
    """Drive an engine over ``case`` and record everything the scheduler decides:
    each step handed to the runner, who finished after each engine step and why,
    the preemptions, and each request's outputs. ``aborts``: request -> engine step
    at which the caller withdraws it."""
    w = case.workload
    engine, executor, runner, seqs = engine_for(case, async_scheduling=async_scheduling)
    engine.scheduler.use_columns = use_columns
    steps_seen = []
    executor.execute = lambda step: steps_seen.append(step) or runner.execute(step)
    arrivals = sorted(zip((r[0] for r in w.requests), seqs, strict=True), key=lambda a: a[0])
    finished, step = [], 0
    while arrivals or engine.has_unfinished():
        while arrivals and arrivals[0][0] <= step:
            engine.add_request(arrivals.pop(0)[1])
        for seq_id, at in aborts.items():
            if at == step:
                engine.scheduler.abort(seq_id)
        finished.append([(s.seq_id, s.finish_reason) for s in engine.step()])
        check_block_accounting(engine.scheduler)
        step += 1
        assert step < 10_000, "no progress"
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    outputs = [(s.token_ids, s.logprobs, s.top_logprobs, s.finish_reason) for s in seqs]
    return steps_seen, finished, engine.scheduler.num_preemptions, outputs


@st.composite
def cases_with_aborts(draw: st.DrawFn, tight_pool: bool = False) -> tuple[Case, dict[int, int]]:
    case = draw(cases(tight_pool=tight_pool))
    n = len(case.workload.requests)
    aborted = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=2))
    return case, {i: draw(st.integers(0, 12)) for i in aborted}


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("tight_pool", [False, True], ids=["roomy", "preempting"])
@given(data=st.data())
def test_the_decode_batch_schedules_and_applies_every_step_as_the_row_loops(
    async_scheduling: bool, tight_pool: bool, data: st.DataObject
) -> None:
    case = data.draw(cases_with_aborts(tight_pool=tight_pool))
    by_columns = trace(*case, use_columns=True, async_scheduling=async_scheduling)
    by_rows = trace(*case, use_columns=False, async_scheduling=async_scheduling)
    assert by_columns == by_rows


def run_roomy(prompts: tuple, max_tokens: tuple, *, max_num_seqs: int):
    """Asynchronous steps with the batch on, a pool with room for everyone, EOS
    ignored: the steps, the preemptions and each request's outputs."""
    w = Workload(
        config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                               max_model_len=64),
        block_size=2, num_blocks=200, prefix_caching=True, num_state_slots=0,
        requests=tuple((0, p, m) for p, m in zip(prompts, max_tokens, strict=True)),
    )  # fmt: skip
    case = Case(workload=w, stops=(((), True),) * len(prompts))
    steps, _, preemptions, outputs = trace(case, {}, use_columns=True, async_scheduling=True)
    return steps, preemptions, outputs


@pytest.mark.parametrize("max_tokens", [(12, 12, 12, 12), (6, 9, 12, 14)],
                         ids=["together", "staggered"])
def test_a_decode_workload_leaves_the_row_loops_after_its_prefill(
    monkeypatch, max_tokens
) -> None:
    """Guards the properties above against the batch silently never running: with
    room for everyone and no preemption, only the prefill step (whole prompts, every
    row sampling) is planned row by row, and every decode step follows from the step
    before it, also while requests finish one after another (a finish only drops its
    row)."""
    calls = {"plan": 0, "apply": 0}
    plan_by_row, apply_by_row = Scheduler._plan_by_row, Scheduler._apply_by_row

    def counting_plan(self, *args):
        calls["plan"] += 1
        return plan_by_row(self, *args)

    def counting_apply(self, seqs, sizes, tokens, *args):
        if sizes.count(1) == len(sizes):
            calls["apply"] += 1  # a decode step applied row by row
        return apply_by_row(self, seqs, sizes, tokens, *args)

    monkeypatch.setattr(Scheduler, "_plan_by_row", counting_plan)
    monkeypatch.setattr(Scheduler, "_apply_by_row", counting_apply)
    prompts = tuple(tuple(range(10 * i, 10 * i + 5)) for i in range(4))
    steps, preemptions, outputs = run_roomy(prompts, max_tokens, max_num_seqs=4)
    # The prefill step, planned by the row loop, then every decode step from its
    # columns (the last token of the longest is sampled by its step max_tokens - 1
    # after the prefill).
    assert preemptions == 0 and len(steps) == max(max_tokens)
    assert calls == {"plan": 1, "apply": 0}
    for prompt, m, (tokens, _, _, reason) in zip(prompts, max_tokens, outputs, strict=True):
        assert tokens[len(prompt):] == reference_outputs(prompt, m, 64) and reason == "length"


def test_requests_admitted_as_others_finish_join_the_batch(monkeypatch) -> None:
    """A queue longer than ``max_num_seqs``: each step that admits a request (whose
    whole prompt is prefilled in it) is planned from the batch plus the admission
    loop, and the step after it follows from that step's columns: the row loop plans
    only the first step."""
    plan_calls = []
    plan_by_row = Scheduler._plan_by_row
    monkeypatch.setattr(Scheduler, "_plan_by_row",
                        lambda self, *a: plan_calls.append(1) or plan_by_row(self, *a))
    prompts = tuple(tuple(range(10 * i, 10 * i + 3 + i % 4)) for i in range(8))
    lengths = tuple(3 + 2 * i % 7 for i in range(8))
    steps, preemptions, outputs = run_roomy(prompts, lengths, max_num_seqs=3)
    admitting = [st for st in steps if any(len(t) > 1 for t in st.token_ids)]
    assert preemptions == 0 and len(admitting) > 3
    assert plan_calls == [1]
    for prompt, m, (tokens, _, _, _) in zip(prompts, lengths, outputs, strict=True):
        assert tokens[len(prompt):] == reference_outputs(prompt, m, 64)
