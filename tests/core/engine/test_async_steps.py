"""Asynchronous steps on the engine side, against a fake runner with a simulated cache.

With ``async_scheduling`` the engine schedules step N+1 before it applies step N: a
sequence's newest token is a placeholder the runner fills from its own last samples,
and a request ended by a stop token runs one step too many. Whatever the workload
(chunking, prefix hits, state slots, stop tokens, EOS, a pool tight enough to
preempt, requests arriving mid-run), every request gets exactly the tokens and
logprobs of synchronous steps, which are the cache-free reference cut at its first
stop; nothing past a stop is ever returned; and block accounting is exact after
every step, with everything free at the end.
"""

from __future__ import annotations

import attrs
import pytest
from engine_sim import (
    FakeRunner,
    Workload,
    check_block_accounting,
    check_fairness,
    drive,
    fake_logprob,
    fake_next_token,
    reference_outputs,
    request_params,
    workloads,
)
from hypothesis import given
from hypothesis import strategies as st

from kvrunner.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrunner.engine.block_manager import BlockManager
from kvrunner.engine.llm_engine import LLMEngine
from kvrunner.engine.scheduler import Scheduler
from kvrunner.engine.sequence import Sequence, SequenceStatus
from kvrunner.engine.step_io import SampledToken, StepInput
from kvrunner.sampling_params import SamplingParams

EOS = fake_next_token([])


class FakeExecutor:
    """The engine's executor over a :class:`FakeRunner` (it has no ``submit``)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.runner: FakeRunner | None = None

    def execute(self, step: StepInput) -> list[SampledToken]:
        assert self.runner is not None
        return self.runner.execute(step)


@attrs.frozen
class Case:
    workload: Workload
    #: per request: its stop tokens, and whether EOS is ignored
    stops: tuple[tuple[tuple[int, ...], bool], ...]


@st.composite
def cases(draw: st.DrawFn, tight_pool: bool = False) -> Case:
    """A workload whose requests stop early: a stop token taken from the request's own
    reference output (so it really is generated), or EOS, or only max_tokens."""
    w = draw(workloads(tight_pool=tight_pool))
    stops = []
    for _, prompt, max_tokens in w.requests:
        ref = reference_outputs(prompt, max_tokens, w.config.max_model_len)
        stop = (draw(st.sampled_from(ref)),) if ref and draw(st.booleans()) else ()
        stops.append((stop, draw(st.booleans())))
    return Case(workload=w, stops=tuple(stops))


def expected_outputs(case: Case, i: int) -> tuple[list[int], str]:
    """The reference output of request ``i`` cut after its first stop, and why it ended."""
    _, prompt, max_tokens = case.workload.requests[i]
    stop, ignore_eos = case.stops[i]
    out = reference_outputs(prompt, max_tokens, case.workload.config.max_model_len)
    for k, token in enumerate(out):
        if token in stop or (token == EOS and not ignore_eos):
            return out[: k + 1], "stop"
    return out, "length"


def engine_for(
    case: Case, *, async_scheduling: bool
) -> tuple[LLMEngine, FakeExecutor, FakeRunner, list[Sequence]]:
    """An engine over a fake runner for ``case``, and its requests (not yet added)."""
    w = case.workload
    config = EngineConfig(
        cache=CacheConfig(block_size=w.block_size, enable_prefix_caching=w.prefix_caching),
        scheduler=attrs.evolve(w.config, async_scheduling=async_scheduling),
    )
    executor = FakeExecutor(w.num_blocks)
    engine = LLMEngine(config, executor, eos_token_ids=(EOS,), vocab_size=1000,
                       uses_state_slots=w.num_state_slots > 0)  # fmt: skip
    executor.runner = runner = FakeRunner(engine.block_manager)
    seqs = [
        Sequence(i, list(prompt), request_params(w, i, max_tokens=m, stop_token_ids=stop,
                                                 ignore_eos=ignore_eos))  # fmt: skip
        for i, ((_, prompt, m), (stop, ignore_eos)) in enumerate(
            zip(w.requests, case.stops, strict=True)
        )
    ]
    return engine, executor, runner, seqs


def run(
    case: Case, *, async_scheduling: bool, aborts: dict[int, int] | None = None
) -> tuple[LLMEngine, list[Sequence], FakeRunner]:
    """Drive the engine to completion, checking block accounting after every step.
    ``aborts``: request -> the engine step before which the caller withdraws it."""
    w = case.workload
    engine, _, runner, seqs = engine_for(case, async_scheduling=async_scheduling)
    arrivals = sorted(zip((r[0] for r in w.requests), seqs, strict=True), key=lambda a: a[0])
    steps = 0
    while arrivals or engine.has_unfinished():
        while arrivals and arrivals[0][0] <= steps:
            engine.add_request(arrivals.pop(0)[1])
        for i, at in (aborts or {}).items():
            if at == steps:
                engine.abort_request(i)
        for seq in engine.step():
            assert seq.is_finished
        steps += 1
        assert steps < 10_000, "no progress"
        check_block_accounting(engine.scheduler)
        check_fairness(engine.scheduler)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.num_free_state_slots == bm.num_state_slots
    return engine, seqs, runner


def check_against_reference(case: Case, seqs: list[Sequence]) -> None:
    for i, seq in enumerate(seqs):
        tokens, reason = expected_outputs(case, i)
        assert seq.status is SequenceStatus.FINISHED
        assert (seq.output_token_ids, seq.finish_reason) == (tokens, reason)
        assert seq.logprobs == [
            fake_logprob(seq.token_ids[:n]) for n in range(seq.num_prompt_tokens, seq.num_tokens)
        ]


def same_results(a: list[Sequence], b: list[Sequence]) -> bool:
    return [(s.output_token_ids, s.logprobs, s.finish_reason) for s in a] == [
        (s.output_token_ids, s.logprobs, s.finish_reason) for s in b
    ]


@given(cases())
def test_async_steps_give_the_tokens_of_sync_steps_and_nothing_past_a_stop(case: Case) -> None:
    _, async_seqs, _ = run(case, async_scheduling=True)
    _, sync_seqs, _ = run(case, async_scheduling=False)
    check_against_reference(case, async_seqs)
    assert same_results(async_seqs, sync_seqs)


@given(cases(tight_pool=True))
def test_async_steps_under_preemption_give_the_tokens_of_sync_steps(case: Case) -> None:
    _, async_seqs, _ = run(case, async_scheduling=True)
    _, sync_seqs, _ = run(case, async_scheduling=False)
    check_against_reference(case, async_seqs)
    assert same_results(async_seqs, sync_seqs)


def one_request_case(stop: tuple[int, ...], max_tokens: int) -> Case:
    prompt = (5, 6, 7)
    w = Workload(
        config=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64),
        block_size=2, num_blocks=40, prefix_caching=True, num_state_slots=0,
        requests=((0, prompt, max_tokens),),
    )  # fmt: skip
    return Case(workload=w, stops=((stop, True),))


def test_a_stop_token_costs_one_discarded_step_and_a_length_limit_none() -> None:
    ref = reference_outputs((5, 6, 7), 8, 64)
    stop = ref[3]
    assert stop not in ref[:3], "precondition: the stop first appears at output 4"
    engine, (seq,), runner = run(one_request_case((stop,), 8), async_scheduling=True)
    assert seq.output_token_ids == ref[:4] and seq.finish_reason == "stop"
    assert runner.rows_run == 1 + 4  # the prefill, 3 decodes and one past the stop
    _, (seq,), runner = run(one_request_case((), 4), async_scheduling=True)
    assert seq.output_token_ids == ref[:4] and seq.finish_reason == "length"
    assert runner.rows_run == 1 + 3  # the last token's step is never scheduled


def test_the_placeholder_feeds_the_previous_step_sample() -> None:
    case = one_request_case((), 3)
    config = EngineConfig(scheduler=case.workload.config, cache=CacheConfig(block_size=2))
    executor = FakeExecutor(40)
    engine = LLMEngine(config, executor, eos_token_ids=(), vocab_size=1000,
                       uses_state_slots=False)  # fmt: skip
    executor.runner = FakeRunner(engine.block_manager)
    seen: list[StepInput] = []
    executor.execute = lambda step: seen.append(step) or executor.runner.execute(step)
    engine.add_request(Sequence(0, [5, 6, 7], SamplingParams(max_tokens=3)))
    engine.step()  # launches the prefill
    engine.step()  # launches the first decode before the prefill's token is known
    assert seen[1].token_ids == [(-1,)] and seen[1].start_pos == [3]
    assert seen[1].num_output_tokens == [1]  # seeds see the token in flight
    assert engine.scheduler.running[0].num_output_tokens == 1  # the prefill's, applied


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_engine_has_work_until_the_last_launched_step_is_applied(async_scheduling) -> None:
    case = one_request_case((), 1)
    engine, (seq,), _ = run(case, async_scheduling=async_scheduling)
    assert seq.num_output_tokens == 1 and not engine.has_unfinished()


def test_a_request_aborted_with_two_steps_in_flight_frees_everything_once() -> None:
    bm = BlockManager(num_blocks=40, block_size=2, num_state_slots=2)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8,
                                      max_model_len=64), bm)  # fmt: skip
    runner = FakeRunner(bm)
    gone, kept = (Sequence(i, [5 + i, 6, 7], SamplingParams(max_tokens=6)) for i in range(2))
    sched.add(gone)
    sched.add(kept)
    first = sched.schedule()  # the prefills, launched...
    first_out = runner.execute(first[0])
    second = sched.schedule()  # ...and the first decode behind them
    second_out = runner.execute(second[0])
    assert sched.abort(0) is gone and gone.block_table == [] and gone.state_slot == -1
    sched.update(first[1], first_out)
    sched.update(second[1], second_out)
    assert gone.num_output_tokens == 0  # nothing is applied after the abort
    drive(sched, runner)
    assert kept.output_token_ids == reference_outputs((6, 6, 7), 6, 64)
    assert bm.num_free_blocks == bm.num_blocks and bm.num_free_state_slots == bm.num_state_slots


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_the_engine_aborts_a_running_request_by_id_and_the_others_run_on(
    async_scheduling: bool,
) -> None:
    """``LLMEngine.abort_request`` (the engine's abort path, through
    ``Scheduler.abort``): the request ends with "abort" holding only tokens it really
    sampled, frees everything at once, and a second abort or an unknown id is None."""
    w = Workload(
        config=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64),
        block_size=2, num_blocks=60, prefix_caching=True, num_state_slots=3,
        requests=tuple((0, (5 + i, 6, 7), 8) for i in range(3)),
    )  # fmt: skip
    case = Case(workload=w, stops=(((), True),) * 3)
    engine, _, _, seqs = engine_for(case, async_scheduling=async_scheduling)
    for seq in seqs:
        engine.add_request(seq)
    for _ in range(3):
        engine.step()
    bm = engine.block_manager
    held = len(seqs[1].block_table)
    free_before = bm.num_free_blocks
    assert engine.abort_request(1) is seqs[1] and seqs[1].finish_reason == "abort"
    assert seqs[1].block_table == [] and seqs[1].state_slot == -1
    assert bm.num_free_blocks == free_before + held
    assert engine.abort_request(1) is None and engine.abort_request(99) is None
    kept = seqs[1].output_token_ids
    while engine.has_unfinished():
        engine.step()
        check_block_accounting(engine.scheduler)
    assert seqs[1].output_token_ids == kept  # nothing applied after the abort
    assert kept == reference_outputs((6, 6, 7), 8, 64)[: len(kept)] and kept
    for i in (0, 2):
        assert seqs[i].output_token_ids == reference_outputs((5 + i, 6, 7), 8, 64)
    assert bm.num_free_blocks == bm.num_blocks and bm.num_free_state_slots == 3


@st.composite
def cases_with_aborts(draw: st.DrawFn, tight_pool: bool = False) -> tuple[Case, dict[int, int]]:
    """A case, and up to two of its requests withdrawn by the caller (request ->
    the engine step before which ``abort_request`` is called)."""
    case = draw(cases(tight_pool=tight_pool))
    n = len(case.workload.requests)
    aborted = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=2))
    return case, {i: draw(st.integers(0, 12)) for i in aborted}


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("tight_pool", [False, True], ids=["roomy", "preempting"])
@given(data=st.data())
def test_aborts_at_any_step_leave_every_other_request_its_reference_outputs(
    async_scheduling: bool, tight_pool: bool, data: st.DataObject
) -> None:
    """Requests withdrawn at random steps (waiting, running, preempted, with a step in
    flight or not): each other request still gets exactly its reference outputs,
    an aborted one keeps a prefix of its own and ends with "abort" (unless it ended
    first), accounting is exact after every step, and everything is free at the end."""
    case, aborts = data.draw(cases_with_aborts(tight_pool=tight_pool))
    _, seqs, _ = run(case, async_scheduling=async_scheduling, aborts=aborts)
    for i, seq in enumerate(seqs):
        tokens, reason = expected_outputs(case, i)
        assert seq.status is SequenceStatus.FINISHED
        if seq.finish_reason == "abort":
            assert i in aborts and seq.output_token_ids == tokens[: seq.num_output_tokens]
        else:
            assert (seq.output_token_ids, seq.finish_reason) == (tokens, reason)
        assert seq.logprobs == [
            fake_logprob(seq.token_ids[:n]) for n in range(seq.num_prompt_tokens, seq.num_tokens)
        ]
