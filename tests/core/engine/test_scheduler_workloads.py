"""Scheduler properties over random workloads driven to completion by a fake runner.

Every step is checked (token budget, max_num_seqs, block tables covering each chunk,
exact ref counts, no sharing but of published full blocks, arrival-order fairness),
and every request's outputs must equal a cache-free reference generation, whatever
the batching, chunking, prefix hits and preemptions along the way.
"""

from __future__ import annotations

import random

from engine_sim import (
    FakeRunner,
    Workload,
    drive,
    fake_logprob,
    fake_next_token,
    reference_outputs,
    request_params,
    workloads,
)
from hypothesis import given
from hypothesis import strategies as st

from kvrunner.config import SchedulerConfig
from kvrunner.engine.block_manager import BlockManager
from kvrunner.engine.scheduler import Scheduler
from kvrunner.engine.sequence import Sequence, SequenceStatus
from kvrunner.engine.step_io import SampledTokens, StepInput, unpack_sampled


class ColumnsRunner(FakeRunner):
    """Answers as the real runner does, in columns (``SampledTokens``), in row order
    or, given a ``shuffle``, in any order."""

    def __init__(self, block_manager: BlockManager, shuffle: random.Random | None) -> None:
        super().__init__(block_manager)
        self.shuffle = shuffle

    def execute(self, step: StepInput) -> SampledTokens:
        tokens = list(super().execute(step))
        if self.shuffle is not None:
            self.shuffle.shuffle(tokens)
        columns = SampledTokens.of(tokens)
        return unpack_sampled(
            (columns.seq_ids, columns.token_ids, columns.logprobs, columns.top_logprobs)
        )


def run_workload(
    w: Workload, runner: type[FakeRunner] = FakeRunner,
    retract_at: frozenset[int] = frozenset(), **kw: object
) -> tuple[Scheduler, list[Sequence]]:
    bm = BlockManager(w.num_blocks, w.block_size, w.prefix_caching, w.num_state_slots)
    sched = Scheduler(w.config, bm, eos_token_id=fake_next_token([]))
    seqs = [
        Sequence(i, list(prompt), request_params(w, i, max_tokens=m, ignore_eos=True))
        for i, (_, prompt, m) in enumerate(w.requests)
    ]
    arrivals = [(step, seq) for (step, _, _), seq in zip(w.requests, seqs, strict=True)]
    drive(sched, runner(bm, **kw), arrivals, retract_at=retract_at)
    return sched, seqs


def check_outputs(w: Workload, sched: Scheduler, seqs: list[Sequence]) -> None:
    max_len = w.config.max_model_len
    for seq in seqs:
        expected = reference_outputs(seq.prompt_token_ids, seq.sampling_params.max_tokens, max_len)
        assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "length"
        assert seq.output_token_ids == expected
        assert len(expected) == min(seq.sampling_params.max_tokens, max_len - seq.num_prompt_tokens)
        assert seq.logprobs == [
            fake_logprob(seq.token_ids[:i]) for i in range(seq.num_prompt_tokens, seq.num_tokens)
        ]
        assert seq.block_table == [] and seq.state_slot == -1
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.num_free_state_slots == bm.num_state_slots
    assert not sched.has_unfinished() and sched.schedule() is None


@given(workloads())
def test_every_request_finishes_with_its_reference_outputs(w: Workload) -> None:
    sched, seqs = run_workload(w)
    check_outputs(w, sched, seqs)


@given(workloads(tight_pool=True))
def test_a_tight_pool_preempts_and_every_request_still_completes_correctly(w: Workload) -> None:
    sched, seqs = run_workload(w)
    check_outputs(w, sched, seqs)


@given(workloads(), st.frozensets(st.integers(1, 40), max_size=6))
def test_retracting_every_running_request_at_any_steps_still_completes_each_correctly(
    w: Workload, retract_at: frozenset[int]
) -> None:
    sched, seqs = run_workload(w, retract_at=retract_at)
    check_outputs(w, sched, seqs)


@given(workloads(tight_pool=True))
def test_the_running_batch_keeps_every_requests_sampling_settings_in_its_columns(
    w: Workload,
) -> None:
    """Requests with every kind of sampling settings, admitted (rows appended),
    preempted (the tail cut) and finished (rows removed) in any order: after every
    step the running batch's sampling columns are its sequences' ``SamplingParams``
    row for row and every row past them is clear (``check_running_batch``), and each
    step carries its rows' settings (``check_step``)."""
    assert len(w.sampling) == len(w.requests)
    sched, seqs = run_workload(w)
    check_outputs(w, sched, seqs)
    assert [s.sampling_params for s in seqs] == [
        request_params(w, i, max_tokens=m, ignore_eos=True)
        for i, (_, _, m) in enumerate(w.requests)
    ]


@given(workloads(tight_pool=True), st.randoms(use_true_random=False))
def test_update_reads_columns_in_row_order_or_any_order_as_it_reads_objects(
    w: Workload, rng: random.Random
) -> None:
    """The runner answers in columns, in row order (update's fast path); tests answer
    with SampledToken objects; any other order is matched by seq id. All alike."""
    results = []
    for runner, kw in [(FakeRunner, {}), (ColumnsRunner, {"shuffle": None}),
                       (ColumnsRunner, {"shuffle": rng})]:  # fmt: skip
        sched, seqs = run_workload(w, runner, **kw)
        check_outputs(w, sched, seqs)
        results.append(([s.token_ids for s in seqs], [s.logprobs for s in seqs],
                        sched.num_preemptions))  # fmt: skip
    assert results[0] == results[1] == results[2]


def test_the_tight_pool_workloads_do_exercise_preemption() -> None:
    """Guards the property above against silently never preempting."""
    w = Workload(
        config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64),
        block_size=2,
        num_blocks=6,
        prefix_caching=True,
        num_state_slots=0,
        requests=tuple((0, tuple(range(10 * i, 10 * i + 4)), 6) for i in range(3)),
    )
    sched, seqs = run_workload(w)
    assert sched.num_preemptions > 0
    check_outputs(w, sched, seqs)
