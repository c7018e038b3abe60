"""A property over random interleavings of what an RL driver does to an AsyncLLM:
generate, stream, abort, cancel, pause (abort | keep | wait), resume, sleep / wake and
weight updates, with the engine stepping in its own thread meanwhile.

- every request ends exactly once (one final delta, last), with finish reason
  ``"abort"`` only if something aborted it, and never a normal end after
  ``abort()`` said it withdrew it;
- every token equals the synchronous engine's under the weights its
  ``weight_versions`` spans say made it (``async_reference.Reference`` switches
  weights at the same output positions), so a parked request continued on stale
  or reused blocks, or a span that lies, shows up as a wrong token;
- at idle the pool is full again: no block or state slot held, none leaked.
"""

from __future__ import annotations

import asyncio
from typing import Any

import attrs
from async_reference import SETTINGS, Reference, assert_matches, weights_of
from hypothesis import example, given
from hypothesis import strategies as st

from kvrunner import LLM, AsyncLLM, EngineBusyError, SamplingParams

#: no prompt is a prefix of another, so the prefix cache shares no blocks across them
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20], [3, 4],
           [21, 22, 23, 24, 25, 26]]  # fmt: skip

params = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 8),
    temperature=st.sampled_from([0.0, 0.8]),
    seed=st.integers(0, 2),  # seeded: the draws do not depend on the schedule
    ignore_eos=st.booleans(),
    logprobs=st.sampled_from([None, 0]),
)
ops = st.one_of(
    st.tuples(st.just("gen"), st.integers(0, len(PROMPTS) - 1), params, st.booleans()),
    st.tuples(st.just("gen"), st.integers(0, len(PROMPTS) - 1), params, st.booleans()),
    st.tuples(st.just("abort"), st.integers(0, 20)),
    st.tuples(st.just("cancel"), st.integers(0, 20)),
    st.tuples(st.just("pause"), st.sampled_from(["abort", "keep", "wait"])),
    st.tuples(st.just("resume")),
    st.tuples(st.just("update"), st.integers(0, 1)),
    st.tuples(st.just("run"), st.integers(0, 3)),  # let the engine step a while
    st.tuples(st.just("sleep_wake")),
)
scripts = st.lists(ops, min_size=3, max_size=14)


@attrs.define(eq=False)
class Req:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    stream: bool
    #: position in the script: an abort-causing op after it may end it with "abort"
    index: int
    task: Any = None
    deltas: list = attrs.field(factory=list)
    #: abort() said it withdrew this request
    abort_ok: bool = False
    #: an abort_all-like op (pause("abort")) came after its submission
    swept: bool = False


async def consume(engine: AsyncLLM, req: Req):
    async for delta in engine.generate_stream(req.prompt, req.params, req.request_id):
        req.deltas.append(delta)
    return req.deltas[-1].output


async def play(engine: AsyncLLM, script: list[tuple], labels: dict[Any, int]) -> list[Req]:
    reqs: list[Req] = []
    paused, updates = False, 0
    for i, op in enumerate(script):
        kind = op[0]
        if kind == "gen":
            _, p, sp, stream = op
            req = Req(f"q{len(reqs)}", PROMPTS[p], sp, stream, i)
            coro = consume(engine, req) if stream else engine.generate(req.prompt, sp,
                                                                       req.request_id)
            req.task = asyncio.create_task(coro)
            reqs.append(req)
            await asyncio.sleep(0)  # the task runs to its submission: script order holds
        elif kind == "abort" and reqs:
            req = reqs[op[1] % len(reqs)]
            if await engine.abort(req.request_id):
                req.abort_ok = True
        elif kind == "cancel" and reqs:
            reqs[op[1] % len(reqs)].task.cancel()
        elif kind == "pause":
            await engine.pause(op[1])
            paused = True
            stats = engine.stats()
            assert stats.paused and stats.pause_mode == op[1]
            if op[1] == "abort":
                for req in reqs:
                    req.swept = True
                assert (stats.num_running, stats.num_waiting, stats.blocks_used) == (0, 0, 0)
            if op[1] == "wait":  # done; only requests held by an earlier pause wait
                assert stats.num_running == 0
            if op[1] == "keep":  # parked: nothing steps until resume()
                before = stats.generated_tokens_total
                await asyncio.sleep(0.005)
                assert engine.stats().generated_tokens_total == before
        elif kind == "resume":
            await engine.resume()
            paused = False
        elif kind == "update":
            updates += 1
            label = f"w{op[1]}-{updates}"
            try:
                await engine.update_weights(WEIGHTS[op[1]], weight_version=label)
            except EngineBusyError:
                assert not paused  # refused only while requests run unpaused
            else:
                labels[label] = op[1]
        elif kind == "run":
            await asyncio.sleep(0.002 * op[1])
        elif kind == "sleep_wake":
            try:
                await engine.sleep(1)
            except EngineBusyError:
                pass  # requests were in the engine: refused, nothing changed
            else:
                await engine.wake_up()
    if paused:
        await engine.resume()
    await asyncio.gather(*(r.task for r in reqs), return_exceptions=True)
    return reqs


WEIGHTS: list[dict] = []


#: always tried: requests parked across an update and continued, streamed and not; a
#: sleep while they are parked (refused: it would free their KV)
PARKED_ACROSS_AN_UPDATE = [
    ("gen", 0, SamplingParams(max_tokens=8, temperature=0.0, logprobs=0), True),
    ("gen", 2, SamplingParams(max_tokens=8, temperature=0.8, seed=1), False),
    ("run", 2), ("pause", "keep"), ("sleep_wake",), ("update", 1), ("resume",), ("abort", 1),
]  # fmt: skip


@given(script=scripts)
@example(script=PARKED_ACROSS_AN_UPDATE)
def test_random_interleavings_end_every_request_once_with_the_reference_tokens(
    served: LLM, checkpoints, reference: Reference, script
) -> None:
    if not WEIGHTS:
        WEIGHTS.extend(weights_of(p) for p in checkpoints)
    served.load_weights(checkpoints[0], weight_version=0)  # each example: the first weights
    labels: dict[Any, int] = {0: 0}

    async def run():
        engine = AsyncLLM.from_llm(served)
        try:
            # a request that never ends fails the example rather than hanging it
            reqs = await asyncio.wait_for(play(engine, script, labels), timeout=60)
            await engine.wait_for_requests_to_drain(timeout=30)
            for req in reqs:  # nothing of theirs is live any more
                assert await engine.abort(req.request_id) is False
            await engine.cache_info()  # a command: the stats are published before its reply
            return reqs, engine.stats()
        finally:
            await engine.shutdown()

    reqs, stats = asyncio.run(run())
    assert (stats.num_running, stats.num_waiting, stats.blocks_used, stats.state_slots_used) == (
        0, 0, 0, 0)  # fmt: skip
    manager = served.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks == SETTINGS["num_blocks"]
    assert manager.num_free_state_slots == manager.num_state_slots
    assert not served.engine.has_unfinished()

    aborted, cancelled = 0, 0
    for req in reqs:
        if req.task.cancelled():
            cancelled += 1
            assert not any(d.finish_reason for d in req.deltas[:-1])
            continue
        out = req.task.result()
        if req.stream:  # one final delta, the last; the deltas add up to the output
            reasons = [d.finish_reason for d in req.deltas]
            assert reasons[-1] is not None and not any(reasons[:-1])
            assert sum((d.token_ids for d in req.deltas), []) == out.token_ids
        assert out.request_id == req.request_id
        spans = out.weight_versions
        assert spans[0][1] == 0 and out.weight_version == spans[-1][0]
        starts = [start for _, start in spans]
        assert starts == sorted(set(starts))
        assert all(start < len(out.token_ids) for start in starts[1:])
        want = reference.output(req.prompt, req.params,
                                tuple((labels[v], start) for v, start in spans))  # fmt: skip
        if out.finish_reason == "abort":
            aborted += 1
            assert req.abort_ok or req.swept, f"{req.request_id} ended 'abort' unasked"
            assert_matches(out, want, prefix=True)
        else:
            assert not req.abort_ok, f"abort({req.request_id!r}) said True, yet it ran on"
            assert_matches(out, want)
    assert aborted <= stats.num_aborted <= aborted + cancelled

