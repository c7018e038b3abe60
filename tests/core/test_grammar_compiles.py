"""Grammars compile off the engine's thread: a constrained request waits for its grammar
outside the scheduler while every other request steps on.

Measured in engine steps, not seconds: an unconstrained request beside one whose JSON
schema takes long to compile gets every token in the steps it takes alone, and is done
while the other is still compiling. A request aborted while its grammar compiles ends
once, with ``"abort"``, and never comes back when the compile ends; a constraint that
does not parse or compile ends its request with ``"error"`` naming the field, once,
and the engine serves on; a constrained request draws the same tokens whether its
grammar was ready at once or after others ran.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

xgr = pytest.importorskip("xgrammar")

from kvrunner import LLM, AsyncLLM, RequestError, SamplingParams  # noqa: E402
from kvrunner.engine.grammar_compiler import GrammarCompiler  # noqa: E402
from kvrunner.structured_outputs import StructuredOutputsParams  # noqa: E402

ENGINE = dict(max_num_seqs=8, max_model_len=256, num_blocks=256, block_size=4, seed=0)
PROMPT = [5, 17, 42]
#: steps an unconstrained request of PLAIN_TOKENS tokens takes: its prefill samples
#: the first, and asynchronous steps hand each token back one step late
PLAIN_TOKENS = 6


def slow_schema(fields: int, tag: str) -> dict:
    """A JSON schema of ``fields`` required object properties, each with a pattern, an
    integer range and an enum: xgrammar takes about a second to compile 400 of them
    for the tiny vocabulary. ``tag`` makes each schema its own (no compile cache hit)."""
    return {"type": "object", "additionalProperties": False,
            "required": [f"{tag}_{i}" for i in range(fields)],
            "properties": {f"{tag}_{i}": {
                "type": "object", "required": ["a", "b", "c"],
                "properties": {"a": {"type": "string", "pattern": f"[a-z]{{1,{i % 7 + 2}}}"},
                               "b": {"type": "integer", "minimum": i, "maximum": i * 37 + 5},
                               "c": {"enum": [f"v{i}_{k}" for k in range(5)]}}}
                for i in range(fields)}}


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-qwen3", **ENGINE) as llm:
        yield llm


def plain_params() -> SamplingParams:
    return SamplingParams(max_tokens=PLAIN_TOKENS, temperature=1.0, seed=11, ignore_eos=True)


def test_compiling_grammar_releases_the_gil(llm) -> None:
    """What the design rests on: Python keeps running at most of its pace while xgrammar
    compiles on another thread."""
    compiler = GrammarCompiler(llm.tokenizer, llm.engine.vocab_size, [0])
    params = StructuredOutputsParams(json=json.dumps(slow_schema(400, "gil")))
    done: list[float] = []

    def count(seconds: float, until=None) -> float:
        start, n = time.perf_counter(), 0
        while (until is None and time.perf_counter() - start < seconds) or \
                (until is not None and not until()):
            n += 1
        return n / (time.perf_counter() - start)

    alone = count(0.3)
    worker = threading.Thread(target=lambda: done.append(bool(compiler.compile(params))))
    worker.start()
    beside = count(0, until=lambda: bool(done))
    worker.join()
    assert beside > 0.1 * alone, (alone, beside)  # held, it would be next to nothing


def test_an_unconstrained_request_runs_its_course_while_a_slow_grammar_compiles(llm) -> None:
    engine = llm.engine
    slow = SamplingParams(max_tokens=8, temperature=1.0, seed=3, structured_outputs={
        "json": slow_schema(400, "slow"), "disable_any_whitespace": True})
    constrained = engine.make_request(PROMPT, slow, "slow")
    plain = engine.make_request([9, 8, 7], plain_params(), "plain")
    engine.add_request(constrained)
    engine.add_request(plain)
    steps = 0
    while not plain.is_finished:
        engine.step()
        steps += 1
        assert steps <= PLAIN_TOKENS + 1, "the unconstrained request was held up"
    # done in the steps it takes alone, while the other has not started
    assert plain.num_output_tokens == PLAIN_TOKENS and plain.finish_reason == "length"
    assert engine.num_compiling == 1 and constrained.num_output_tokens == 0
    while engine.has_unfinished():
        engine.step()
    assert constrained.finish_reason in ("stop", "length") and constrained.num_output_tokens
    alone = llm.generate([[9, 8, 7]], plain_params())[0]
    assert plain.output_token_ids == alone.token_ids


def test_abort_while_compiling_ends_the_request_once_and_for_good(llm) -> None:
    engine = llm.engine
    params = SamplingParams(max_tokens=8, structured_outputs={"json": slow_schema(300, "ab")})
    seq = engine.make_request(PROMPT, params, "aborted")
    engine.add_request(seq)
    engine.step()
    assert engine.num_compiling == 1
    assert engine.abort_request(seq.seq_id) is seq and seq.finish_reason == "abort"
    assert not engine.has_unfinished() and engine.num_compiling == 0
    assert engine.abort_request(seq.seq_id) is None  # ended once
    time.sleep(2.0)  # the compile ends meanwhile; its result is dropped
    assert engine.step() == [] and not engine.has_unfinished()
    assert seq.num_output_tokens == 0 and seq.finish_reason == "abort"


def test_async_abort_and_bad_constraint_end_their_requests_once() -> None:
    async def run(llm: LLM) -> None:
        engine = AsyncLLM.from_llm(llm)
        try:
            slow = SamplingParams(max_tokens=8, structured_outputs={
                "json": slow_schema(300, "aab")})
            stream = engine.generate_stream(PROMPT, slow, request_id="slow")
            first = asyncio.ensure_future(stream.__anext__())
            plain = await engine.generate([9, 8, 7], plain_params(), request_id="plain")
            assert plain.finish_reason == "length"
            assert engine.stats().num_waiting == 1  # still compiling
            assert await engine.abort("slow")
            final = await first
            assert final.finish_reason == "abort" and final.output.token_ids == []
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()
            assert not await engine.abort("slow")

            bad = SamplingParams(max_tokens=4, structured_outputs={"regex": "a(b"})
            outs = await asyncio.gather(
                engine.generate(PROMPT, bad, request_id="bad"),
                engine.generate([9, 8, 7], plain_params(), request_id="beside"))
            assert outs[0].finish_reason == "error" and outs[0].token_ids == []
            assert outs[0].error.startswith(
                "request bad: SamplingParams.structured_outputs.regex could not be parsed"), \
                outs[0].error
            assert outs[1].finish_reason == "length"
            assert engine.stats().num_waiting == engine.stats().num_running == 0
        finally:
            await engine.shutdown()

    with LLM("tiny-qwen3", **ENGINE) as llm:
        asyncio.run(run(llm))


def test_the_synchronous_api_still_refuses_a_bad_constraint_before_queueing(llm) -> None:
    with pytest.raises(RequestError, match="structured_outputs.regex could not be parsed"):
        llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=2), SamplingParams(
            max_tokens=2, structured_outputs={"regex": "a(b"})])
    assert not llm.engine.has_unfinished()


def test_a_constrained_request_draws_the_same_tokens_whenever_its_grammar_is_ready() -> None:
    schema = {"json": slow_schema(200, "det"), "disable_any_whitespace": True}
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=5, structured_outputs=schema)
    others = [SamplingParams(max_tokens=20, temperature=1.0, seed=s, ignore_eos=True)
              for s in range(3)]
    with LLM("tiny-qwen3", **ENGINE) as first:  # compiled while the others run
        beside = first.generate([[1, 2], PROMPT, [3, 4], [5, 6]],
                                [others[0], params, others[1], others[2]])[1]
        again = first.generate([PROMPT], params)[0]  # the compiler's cache: ready at once
    with LLM("tiny-qwen3", **ENGINE, async_scheduling=False) as second:
        alone = second.generate([PROMPT], params)[0]
    assert beside.token_ids == again.token_ids == alone.token_ids
    assert beside.finish_reason == alone.finish_reason
