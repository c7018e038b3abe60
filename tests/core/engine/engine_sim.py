"""A fake runner with a simulated KV cache, to drive the engine side in tests.

The fake "model" samples a deterministic function of the whole context it reads
*back from its own cache* through the chunk's block table - never from the
scheduler's sequences. So a wrong block table, a prefix-cache hit on the wrong
block, an evicted block still mapped, or a resumed sequence missing KV all change
the sampled tokens (or fail a read), and the outputs stop matching a cache-free
reference generation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import attrs
from hypothesis import strategies as st

from kvrunner.config import SchedulerConfig
from kvrunner.engine.block_manager import BlockManager
from kvrunner.engine.scheduler import Scheduler
from kvrunner.engine.sequence import Sequence as Seq
from kvrunner.engine.sequence import SequenceStatus
from kvrunner.engine.step_io import (
    PLACEHOLDER_TOKEN,
    SAMPLING_DTYPES,
    SampledToken,
    SamplingColumns,
    StepInput,
)
from kvrunner.sampling_params import SamplingParams
from kvrunner.testing.steps import rows_of

VOCAB = 1000


def fake_next_token(context: Sequence[int]) -> int:
    """The fake model: depends on every token of the context and on their order."""
    h = 0
    for t in context:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
    return h % VOCAB


def fake_logprob(context: Sequence[int]) -> float:
    return -len(context) / 1000.0


def reference_outputs(prompt: Sequence[int], max_tokens: int, max_model_len: int) -> list[int]:
    """Cache-free greedy generation with the fake model (EOS ignored)."""
    tokens = list(prompt)
    while len(tokens) - len(prompt) < max_tokens and len(tokens) < max_model_len:
        tokens.append(fake_next_token(tokens))
    return tokens[len(prompt) :]


class FakeRunner:
    """Writes each chunk's tokens into KV slots and samples from what it reads back.

    Like the real runner, it keeps the last step's samples and feeds a chunk's
    ``PLACEHOLDER_TOKEN`` (asynchronous steps) from them.
    """

    def __init__(self, block_manager: BlockManager) -> None:
        self.bm = block_manager
        self.bs = block_manager.block_size
        self.kv: dict[int, int] = {}  # physical slot -> token id whose "KV" is there
        self.previous: dict[int, int] = {}  # seq id -> the token the last step sampled
        self.rows_run = 0  # chunks computed, counting any past a request's end

    def _slot(self, block_table: tuple[int, ...], pos: int) -> int:
        return block_table[pos // self.bs] * self.bs + pos % self.bs

    def execute(self, step: StepInput) -> list[SampledToken]:
        sampled = []
        slots = [s for s in step.state_slot if s != -1]
        # A row past a request's end (asynchronous steps) still owns its state slot.
        assert len(set(slots)) == len(slots), f"two rows share a state slot: {slots}"
        for c in rows_of(step):
            self.rows_run += 1
            end = c.start_pos + len(c.token_ids)
            assert len(c.token_ids) >= 1
            assert len(c.block_table) * self.bs >= end, f"block table too short: {c}"
            tokens = c.token_ids
            if tokens[-1] == PLACEHOLDER_TOKEN:
                tokens = tokens[:-1] + (self.previous[c.seq_id],)
            assert PLACEHOLDER_TOKEN not in tokens
            for pos, token in enumerate(tokens, c.start_pos):
                block = c.block_table[pos // self.bs]
                # Writes land only in a private block that is not a published prefix.
                assert self.bm.pool.ref_count(block) == 1, f"write into shared block {block}"
                assert self.bm.pool.block_hash(block) is None, f"write into cached {block}"
                self.kv[self._slot(c.block_table, pos)] = token
            if c.sample:
                context = [self.kv[self._slot(c.block_table, p)] for p in range(end)]
                sampled.append(
                    SampledToken(
                        seq_id=c.seq_id,
                        token_id=fake_next_token(context),
                        logprob=fake_logprob(context),
                    )
                )
        self.previous = {s.seq_id: s.token_id for s in sampled}
        return sampled


def check_step(sched: Scheduler, step: StepInput, seqs: list[Seq]) -> None:
    """Invariants that must hold for every scheduled step."""
    cfg = sched.config
    assert step.num_tokens <= cfg.max_num_batched_tokens
    assert step.num_seqs == len(seqs) <= cfg.max_num_seqs
    assert len(sched.running) <= cfg.max_num_seqs
    assert len(set(step.seq_id)) == step.num_seqs
    for c, seq in zip(rows_of(step), seqs, strict=True):
        assert c.seq_id == seq.seq_id and seq.status is SequenceStatus.RUNNING
        assert c.start_pos == seq.num_computed_tokens
        assert c.token_ids == tuple(seq.token_ids[c.start_pos : c.start_pos + len(c.token_ids)])
        assert c.sample == (c.start_pos + len(c.token_ids) == seq.num_tokens)
        assert c.num_output_tokens == seq.num_output_tokens
        assert c.block_table == tuple(seq.block_table)
        assert c.sampling == SamplingColumns.of([seq.sampling_params])
        if not cfg.enable_chunked_prefill:
            # Whole prefills only, bar a resumed sequence that outgrew the budget.
            assert c.sample or seq.num_tokens > cfg.max_num_batched_tokens
    check_block_accounting(sched)
    check_fairness(sched)


def check_block_accounting(sched: Scheduler) -> None:
    """Ref counts equal the number of running tables mapping a block; sharing only of
    full, computed, published prefix blocks; every block free or held."""
    bm = sched.block_manager
    mapped: Counter[int] = Counter()
    for seq in sched.running:
        mapped.update(seq.block_table)
        full = seq.num_computed_tokens // bm.block_size
        for i, block in enumerate(seq.block_table):
            if i >= full:
                # A block this sequence may still write is its own.
                assert bm.pool.block_hash(block) is None
    for block, count in mapped.items():
        assert bm.pool.ref_count(block) == count
        if count > 1:
            assert bm.pool.block_hash(block) is not None, f"block {block} shared uncached"
    assert bm.num_free_blocks + len(mapped) == bm.num_blocks
    check_table_rows(sched)
    check_running_batch(sched)
    for seq in sched.waiting:
        assert not seq.block_table and seq.state_slot == -1 and seq.num_computed_tokens == 0
    slots = [s.state_slot for s in sched.running]
    if bm.num_state_slots:
        assert -1 not in slots and len(set(slots)) == len(slots)
        assert bm.num_free_state_slots + len(slots) == bm.num_state_slots
    else:
        assert set(slots) <= {-1}


def check_table_rows(sched: Scheduler) -> None:
    """The block manager's persistent table rows always equal the sequences' tables:
    one row per running sequence, its blocks then zeros, every other row all zeros."""
    rows = sched.block_manager.table_rows
    held = [seq.table_row for seq in sched.running]
    assert -1 not in held and len(set(held)) == len(held)
    assert rows.num_rows_held == len(held)
    for seq in sched.running:
        assert rows.table(seq.table_row) == seq.block_table
    for seq in sched.waiting:
        assert seq.table_row == -1
    others = [r for r in range(len(rows.array)) if r not in set(held)]
    assert not rows.array[others].any() and not rows.lens[others].any()
    for seq in sched.running:
        assert not rows.array[seq.table_row, len(seq.block_table):].any()


def check_running_batch(sched: Scheduler) -> None:
    """The running batch's columns always say what the sequences and the steps in
    flight say: row i is running[i], its next chunk starts past what the steps in
    flight feed it, its token count includes their samples, its sampling columns are
    its ``SamplingParams`` (``step_io.sampling_row``), and every row past the batch
    is clear. Each step in flight knows where its rows are now (-1: gone)."""
    batch = sched.batch
    n = len(sched.running)
    assert batch.seqs is sched.running
    fed = dict.fromkeys(map(id, sched.running), 0)
    pending = dict.fromkeys(map(id, sched.running), 0)
    for chunks in sched._in_flight:
        for k, seq in enumerate(chunks.seqs):
            row = int(chunks.rows[k])
            if row == -1:
                assert seq.status is not SequenceStatus.RUNNING or seq not in sched.running
                continue
            assert sched.running[row] is seq
            fed[id(seq)] += int(chunks.sizes[k])
            pending[id(seq)] += bool(chunks.sample[k])
    columns = SamplingColumns(*(getattr(batch, name)[:n] for name in SAMPLING_DTYPES))
    assert columns == SamplingColumns.of(s.sampling_params for s in sched.running), (
        "the running batch's sampling columns are not its sequences' SamplingParams")
    assert batch.stop_on == [s.stop_on for s in sched.running]
    for i, seq in enumerate(sched.running):
        assert (
            batch.seq_id[i], batch.pos[i], batch.tokens[i], batch.pending[i], batch.prompt[i],
            batch.limit[i], batch.table_row[i], batch.state_slot[i],
        ) == (
            seq.seq_id, seq.num_computed_tokens + fed[id(seq)],
            len(seq.token_ids) + pending[id(seq)], pending[id(seq)], seq.num_prompt_tokens,
            seq.length_limit, seq.table_row, seq.state_slot,
        ), f"row {i} of the running batch is not {seq}"
    for name in ("seq_id", "pos", "tokens", "pending", "prompt", "limit", "temperature",
                 "top_k", "top_p", "seed", "has_seed"):  # fmt: skip
        assert not getattr(batch, name)[n:].any(), f"a row past the batch holds {name}"
    for name in ("table_row", "state_slot", "logprobs", "prompt_logprobs"):
        assert (getattr(batch, name)[n:] == -1).all(), f"a row past the batch holds {name}"


def check_fairness(sched: Scheduler) -> None:
    """Running is in arrival order and every running sequence arrived before every
    waiting one - so no preemption ever favoured a later arrival."""
    running = [s.arrival for s in sched.running]
    waiting = [s.arrival for s in sched.waiting]
    assert running == sorted(running)
    assert waiting == sorted(waiting)
    if running and waiting:
        assert running[-1] < waiting[0]


def drive(
    sched: Scheduler,
    runner: FakeRunner,
    arrivals: Iterable[tuple[int, Seq]] = (),
    max_steps: int = 10_000,
    retract_at: frozenset[int] = frozenset(),
) -> int:
    """Run to completion, adding ``(step, seq)`` arrivals on their step and retracting
    every running request after the steps in ``retract_at``; returns steps."""
    pending = sorted(arrivals, key=lambda a: a[0])
    steps = 0
    while pending or sched.has_unfinished():
        while pending and pending[0][0] <= steps:
            sched.add(pending.pop(0)[1])
        scheduled = sched.schedule()
        steps += 1
        assert steps <= max_steps, "no progress: scheduler livelocked"
        if scheduled is None:
            assert not sched.has_unfinished(), "work left but nothing scheduled"
            continue
        step, seqs = scheduled
        check_step(sched, step, seqs)
        sched.update(seqs, runner.execute(step))
        check_block_accounting(sched)
        if steps in retract_at:
            waiting = len(sched.waiting)
            retracted = sched.retract_running()
            assert not sched.running and len(sched.waiting) == waiting + retracted
            assert all(not s.block_table and s.num_computed_tokens == 0
                       for s in list(sched.waiting)[:retracted])
            check_block_accounting(sched)
    return steps


#: sampling settings of every kind the running batch's columns hold: greedy or
#: drawing, filtered or not (a top-k past any vocabulary too), seeded (any int, beyond
#: int64 too) or not, logprobs and prompt logprobs asked or not
sampling_settings = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 1.0]) | st.floats(0.01, 5.0),
    top_k=st.integers(-2, 50) | st.just(2**70),
    top_p=st.floats(0.01, 1.0),
    seed=st.none() | st.integers(-(2**64), 2**64),
    logprobs=st.none() | st.integers(0, 5),
    prompt_logprobs=st.none() | st.integers(0, 5),
)


@attrs.frozen
class Workload:
    config: SchedulerConfig
    block_size: int
    num_blocks: int
    prefix_caching: bool
    num_state_slots: int
    requests: tuple[tuple[int, tuple[int, ...], int], ...]  # (arrival step, prompt, max_tokens)
    #: per request, its sampling settings (:func:`request_params` evolves in its
    #: length and stops); empty: the defaults
    sampling: tuple[SamplingParams, ...] = ()


def request_params(w: Workload, i: int, **fields: object) -> SamplingParams:
    """Request ``i``'s params: its sampling settings with ``fields`` (max_tokens, stops)."""
    return attrs.evolve(w.sampling[i] if w.sampling else SamplingParams(), **fields)


@st.composite
def workloads(draw: st.DrawFn, tight_pool: bool = False) -> Workload:
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.sampled_from([10, 24, 64]))
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.integers(1, 5))
    # Prompts share a few stems so that prefix-cache hits actually happen.
    token = st.integers(0, VOCAB - 1)
    stems = draw(st.lists(st.lists(token, min_size=1, max_size=10), min_size=1, max_size=2))
    requests = []
    for _ in range(draw(st.integers(1, 7))):
        prompt = draw(st.sampled_from(stems)) + draw(st.lists(token, max_size=6))
        prompt = tuple(prompt[: max_model_len - 1])
        requests.append((draw(st.integers(0, 6)), prompt, draw(st.integers(1, 8))))
    # The pool must let each request finish alone (add() refuses the rest), no more.
    need = max(-(-(min(len(p) + m, max_model_len) - 1) // block_size) for _, p, m in requests)
    num_blocks = need + (draw(st.integers(0, 2)) if tight_pool else draw(st.integers(0, 12)))
    budget = draw(st.integers(1, 16))
    if not chunked:
        budget = max(budget, max(len(p) for _, p, _ in requests))
    return Workload(
        config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
        ),
        block_size=block_size,
        num_blocks=num_blocks,
        prefix_caching=draw(st.booleans()),
        num_state_slots=max_num_seqs if draw(st.booleans()) else 0,
        requests=tuple(requests),
        sampling=tuple(draw(sampling_settings) for _ in requests),
    )
