"""Scheduler behaviour, case by case: chunking, admission, finishing, rejecting, aborting."""

from __future__ import annotations

import pytest
from engine_sim import FakeRunner, check_step, drive, reference_outputs

from kvrunner.config import SchedulerConfig
from kvrunner.engine.block_manager import BlockManager
from kvrunner.engine.scheduler import Scheduler
from kvrunner.engine.sequence import Sequence, SequenceStatus
from kvrunner.engine.step_io import SampledToken
from kvrunner.sampling_params import SamplingParams
from kvrunner.testing.steps import rows_of


def make(
    num_blocks: int = 64,
    block_size: int = 4,
    eos: int | None = None,
    prefix_caching: bool = True,
    num_state_slots: int = 0,
    **config: object,
) -> tuple[Scheduler, FakeRunner]:
    bm = BlockManager(num_blocks, block_size, prefix_caching, num_state_slots)
    config.setdefault("max_num_batched_tokens", 2048)  # what a CPU rank resolves unset
    config.setdefault("max_model_len", 2048)  # ranks resolve an unset one from the model
    sched = Scheduler(SchedulerConfig(**config), bm, eos_token_id=eos)
    return sched, FakeRunner(bm)


def step(sched: Scheduler, runner: FakeRunner) -> tuple:
    """One checked schedule/execute/update round; returns (chunks, finished)."""
    scheduled = sched.schedule()
    assert scheduled is not None
    step_input, seqs = scheduled
    check_step(sched, step_input, seqs)
    finished = sched.update(seqs, runner.execute(step_input))
    return rows_of(step_input), finished


def params(max_tokens: int = 4, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **kw)


def test_a_long_prompt_is_prefilled_in_chunks_then_decoded_one_token_at_a_time() -> None:
    sched, runner = make(max_num_batched_tokens=4)
    seq = Sequence(0, list(range(10)), params(max_tokens=3))
    sched.add(seq)
    shapes = []
    while sched.has_unfinished():
        chunks, _ = step(sched, runner)
        (c,) = chunks
        shapes.append((c.start_pos, len(c.token_ids), c.sample, c.num_output_tokens))
    assert shapes == [
        (0, 4, False, 0),
        (4, 4, False, 0),
        (8, 2, True, 0),
        (10, 1, True, 1),
        (11, 1, True, 2),
    ]
    assert seq.output_token_ids == reference_outputs(range(10), 3, 2048)


def test_a_decode_chunk_feeds_the_token_sampled_last_step() -> None:
    sched, runner = make()
    seq = Sequence(0, [5, 6, 7], params())
    sched.add(seq)
    step(sched, runner)
    chunks, _ = step(sched, runner)
    assert chunks[0].token_ids == (seq.token_ids[3],) and chunks[0].start_pos == 3


def test_requests_are_batched_continuously_and_admitted_fifo_within_limits() -> None:
    sched, runner = make(max_num_seqs=2, max_num_batched_tokens=7)
    for i in range(3):
        sched.add(Sequence(i, [i] * 3, params(max_tokens=2)))
    chunks, _ = step(sched, runner)
    assert [c.seq_id for c in chunks] == [0, 1]  # max_num_seqs holds 2 back
    chunks, finished = step(sched, runner)
    assert [c.seq_id for c in chunks] == [0, 1] and {s.seq_id for s in finished} == {0, 1}
    chunks, _ = step(sched, runner)
    assert [c.seq_id for c in chunks] == [2]  # joins as soon as a seat frees up


def test_running_decodes_come_before_admitting_and_chunking_fills_the_budget() -> None:
    sched, runner = make(max_num_batched_tokens=6)
    sched.add(Sequence(0, [1, 2], params(max_tokens=5)))
    step(sched, runner)
    sched.add(Sequence(1, list(range(20)), params()))
    chunks, _ = step(sched, runner)
    assert [(c.seq_id, len(c.token_ids)) for c in chunks] == [(0, 1), (1, 5)]


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole() -> None:
    sched, runner = make(max_num_batched_tokens=6, enable_chunked_prefill=False)
    sched.add(Sequence(0, [1, 2], params(max_tokens=2)))
    step(sched, runner)
    sched.add(Sequence(1, list(range(6)), params(max_tokens=1)))
    chunks, _ = step(sched, runner)  # 0 decodes its last token; 5 tokens left < 6
    assert [c.seq_id for c in chunks] == [0]
    chunks, _ = step(sched, runner)
    assert [(c.seq_id, c.start_pos, len(c.token_ids)) for c in chunks] == [(1, 0, 6)]


def test_a_later_request_reuses_the_cached_prefix_of_an_earlier_one() -> None:
    sched, runner = make(block_size=4)
    prompt = list(range(10))
    first = Sequence(0, prompt, params(max_tokens=2))
    sched.add(first)
    drive(sched, runner)
    second = Sequence(1, prompt + [77], params(max_tokens=2))
    sched.add(second)
    chunks, _ = step(sched, runner)
    assert chunks[0].start_pos == 8 and chunks[0].token_ids == (8, 9, 77)
    drive(sched, runner)
    assert second.output_token_ids == reference_outputs(prompt + [77], 2, 2048)


def test_preemption_recomputes_the_latest_arrival_which_resumes_where_it_was() -> None:
    # 2-token blocks, 5 blocks: a and b both fit admitted, not both grown to full size.
    sched, runner = make(num_blocks=5, block_size=2, max_num_batched_tokens=16)
    a = Sequence(0, [1, 2, 3], params(max_tokens=6))
    b = Sequence(1, [4, 5, 6], params(max_tokens=6))
    sched.add(a)
    sched.add(b)
    while sched.num_preemptions == 0:
        step(sched, runner)
    assert sched.running == [a] and list(sched.waiting) == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.num_output_tokens > 0  # generated tokens are kept for the recompute
    drive(sched, runner)
    for seq in (a, b):
        assert seq.output_token_ids == reference_outputs(seq.prompt_token_ids, 6, 2048)


def test_state_slots_follow_running_sequences_and_resumes_start_from_token_zero() -> None:
    sched, runner = make(num_blocks=5, block_size=2, num_state_slots=2, max_num_seqs=2)
    a = Sequence(0, [1, 2, 3], params(max_tokens=6))
    b = Sequence(1, [1, 2, 3], params(max_tokens=6))
    sched.add(a)
    sched.add(b)
    chunks, _ = step(sched, runner)
    assert sorted(c.state_slot for c in chunks) == [0, 1]
    assert [c.start_pos for c in chunks] == [0, 0]  # same prompt, no prefix hit
    while sched.num_preemptions == 0:
        step(sched, runner)
    assert b.state_slot == -1
    while b.status is SequenceStatus.WAITING:
        chunks, _ = step(sched, runner)
    resumed = next(c for c in chunks if c.seq_id == 1)
    assert resumed.start_pos == 0 and resumed.state_slot >= 0
    drive(sched, runner)
    assert b.output_token_ids == reference_outputs([1, 2, 3], 6, 2048)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos_finishes_with_stop_unless_ignored(ignore_eos: bool) -> None:
    prompt = [3, 1, 4]
    expected = reference_outputs(prompt, 6, 2048)
    eos = expected[2]
    assert eos not in expected[:2]
    sched, runner = make(eos=eos)
    seq = Sequence(0, prompt, params(max_tokens=6, ignore_eos=ignore_eos))
    sched.add(seq)
    drive(sched, runner)
    if ignore_eos:
        assert seq.output_token_ids == expected and seq.finish_reason == "length"
    else:
        assert seq.output_token_ids == expected[:3] and seq.finish_reason == "stop"


def test_a_stop_token_finishes_with_stop_even_when_eos_is_ignored() -> None:
    prompt = [2, 7, 1]
    expected = reference_outputs(prompt, 6, 2048)
    sched, runner = make()
    seq = Sequence(0, prompt, params(max_tokens=6, ignore_eos=True, stop_token_ids=[expected[1]]))
    sched.add(seq)
    drive(sched, runner)
    assert seq.output_token_ids == expected[:2] and seq.finish_reason == "stop"


def test_max_model_len_caps_generation_with_length() -> None:
    sched, runner = make(max_model_len=8)
    seq = Sequence(0, [1, 2, 3, 4, 5], params(max_tokens=10))
    sched.add(seq)
    drive(sched, runner)
    assert seq.num_tokens == 8 and seq.num_output_tokens == 3 and seq.finish_reason == "length"


@pytest.mark.parametrize(
    ("kwargs", "prompt", "max_tokens", "message"),
    [
        ({}, [], 4, "request 9: the prompt is empty"),
        ({"max_model_len": 8}, list(range(8)), 1, r"request 9: prompt has 8 tokens.*at most 7"),
        (
            {"max_num_batched_tokens": 4, "enable_chunked_prefill": False},
            list(range(5)),
            1,
            r"request 9: .*max_num_batched_tokens=4 and chunked prefill is off",
        ),
        (
            {"num_blocks": 3},
            list(range(10)),
            4,
            r"request 9: needs up to 4 KV blocks.*has 3 blocks",
        ),
    ],
)
def test_a_request_that_can_never_run_is_rejected_and_the_queue_is_untouched(
    kwargs: dict, prompt: list[int], max_tokens: int, message: str
) -> None:
    sched, runner = make(**kwargs)
    queued = [Sequence(i, [1, 2], params(max_tokens=1)) for i in range(2)]
    for seq in queued:
        sched.add(seq)
    bad = Sequence(9, prompt, params(max_tokens=max_tokens))
    with pytest.raises(ValueError, match=message):
        sched.validate(bad)  # the same check, without queueing on success
    with pytest.raises(ValueError, match=message):
        sched.add(bad)
    assert list(sched.waiting) == queued and bad.arrival == -1
    assert [s.arrival for s in queued] == [0, 1]
    drive(sched, runner)
    assert all(s.finish_reason == "length" for s in queued)


def test_a_duplicate_request_id_is_rejected() -> None:
    sched, _ = make()
    sched.add(Sequence(1, [1], params()))
    with pytest.raises(ValueError, match="request 1: a request with this id"):
        sched.add(Sequence(1, [2], params()))


def test_abort_frees_a_waiting_or_running_request_and_a_mid_step_abort_is_ignored() -> None:
    sched, runner = make(max_num_seqs=1)
    running = Sequence(0, [1, 2, 3], params(max_tokens=8))
    waiting = Sequence(1, [4, 5], params())
    sched.add(running)
    sched.add(waiting)
    step(sched, runner)
    assert sched.abort(1) is waiting and waiting.finish_reason == "abort"
    assert not sched.waiting and sched.abort(1) is None

    step_input, seqs = sched.schedule()
    sampled = runner.execute(step_input)
    assert sched.abort(0) is running and running.is_finished
    assert sched.update(seqs, sampled) == []  # its sampled token is dropped
    assert running.num_output_tokens == 1 and running.finish_reason == "abort"
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not sched.has_unfinished()
    assert sched.schedule() is None


def test_the_step_protocol_is_enforced() -> None:
    sched, runner = make(max_num_batched_tokens=2)
    with pytest.raises(RuntimeError, match="without a scheduled step"):
        sched.update([], [])
    sched.add(Sequence(0, [1, 2, 3], params()))
    step_input, seqs = sched.schedule()
    ahead = sched.schedule()  # one step ahead is allowed (asynchronous steps)...
    with pytest.raises(RuntimeError, match="before update"):
        sched.schedule()  # ...two are not
    assert ahead is not None and ahead[0].start_pos == [2]  # from where the first leaves it
    with pytest.raises(ValueError, match="mid-prefill"):
        sched.update(seqs, [SampledToken(seq_id=0, token_id=1)])
    sched.update(seqs, runner.execute(step_input))
    step_input, seqs = ahead  # the last prompt token: it samples
    with pytest.raises(ValueError, match="no sampled token for sequence 0"):
        sched.update(seqs, [])
    assert seqs[0].num_computed_tokens == 2  # a refused update changed nothing
    sched.update(seqs, runner.execute(step_input))
    assert seqs[0].num_output_tokens == 1



def test_a_scheduler_refuses_an_unresolved_step_budget() -> None:
    """The ranks resolve an unset max_num_batched_tokens; the scheduler never guesses."""
    bm = BlockManager(8, 4, True, 0)
    with pytest.raises(ValueError, match="resolved max_num_batched_tokens"):
        Scheduler(SchedulerConfig(max_model_len=64), bm)


def test_a_scheduler_refuses_an_unresolved_max_model_len() -> None:
    """The ranks resolve an unset max_model_len (model and pool); the scheduler never guesses."""
    bm = BlockManager(8, 4, True, 0)
    with pytest.raises(ValueError, match="resolved max_model_len"):
        Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm)
