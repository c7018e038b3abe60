"""Asynchronous steps end to end on the tiny embedded models (Qwen3; Qwen3-Next with
GDN state slots), on the CPU, where they are the default as everywhere.

For random request mixes - greedy and seeded sampling, logprobs, stop tokens,
EOS, max_tokens from 1, more requests than seats, and a pool small enough to
preempt - asynchronous steps give the tokens, finish reasons and logprobs of
synchronous steps, and never return a token past a stop.

Logprobs agree to 1e-5, not bit for bit: asynchronous steps run a request ended by
a stop one step longer and admit a waiting one a step later, so the batches differ,
and the CPU's matrix products are not bit-identical across batch sizes (the same
tolerance ``test_batch_composition_does_not_change_a_sequence`` allows). Where the
batches coincide, the logprobs are bit for bit the same.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvrunner import LLM, SamplingParams
from kvrunner.config import EngineConfig
from kvrunner.engine.step_io import PLACEHOLDER_TOKEN
from kvrunner.models.tiny import write_tiny_checkpoint
from kvrunner.runner.step.launched_step import DeviceTokens, feed_placeholders, placeholder_rows
from kvrunner.testing.steps import Row, step_of

#: 3 seats, chunked prefill, and a pool of 14 blocks of 4 tokens: any one request fits
#: (12 + 10 tokens), three long ones do not, so some mixes preempt.
SMALL = dict(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64, block_size=4,
             num_blocks=14)  # fmt: skip


@pytest.fixture(scope="module", params=["qwen3", "qwen3-next"])
def llms(request, tmp_path_factory) -> Iterator[dict[bool, LLM]]:
    """The same checkpoint served with asynchronous steps (True) and without (False)."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param) / "m", kind=request.param)
    pair = {flag: LLM(str(path), async_scheduling=flag, **SMALL) for flag in (True, False)}
    assert pair[True].engine.async_scheduling and not pair[False].engine.async_scheduling
    yield pair
    for llm in pair.values():
        llm.shutdown()


request_settings = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 10),
    temperature=st.sampled_from([0.0, 0.8]),
    top_k=st.sampled_from([0, 8]),
    top_p=st.sampled_from([1.0, 0.9]),
    seed=st.integers(0, 1000),  # seeded: the draws do not depend on the schedule
    logprobs=st.sampled_from([None, 0, 2]),
    ignore_eos=st.booleans(),
)
mixes = st.lists(
    st.tuples(st.lists(st.integers(1, 400), min_size=1, max_size=12), request_settings),
    min_size=1,
    max_size=5,  # more than the 3 seats: some requests queue
)


def generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    llm.reset_prefix_cache()  # both modes start from the same (empty) prefix cache
    return llm.generate(prompts, params)


def assert_same_outputs(got: list, want: list) -> None:
    assert [(o.token_ids, o.finish_reason) for o in got] == [
        (o.token_ids, o.finish_reason) for o in want
    ]
    for a, b in zip(got, want, strict=True):
        assert (a.logprobs is None) == (b.logprobs is None)
        if a.logprobs is not None:
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert (a.top_logprobs is None) == (b.top_logprobs is None)
        for x, y in zip(a.top_logprobs or [], b.top_logprobs or [], strict=True):
            assert x.keys() == y.keys() and list(x.values()) == pytest.approx(list(y.values()),
                                                                             abs=1e-5)


def with_stops(params: list[SamplingParams], outputs: list, picks: list[int | None]) -> list:
    """Each request's settings with a stop token taken from its own earlier output
    (so the stop is really generated), or none."""
    new = []
    for p, out, pick in zip(params, outputs, picks, strict=True):
        tokens = out.token_ids
        stop = () if pick is None or not tokens else (tokens[pick % len(tokens)],)
        new.append(attrs.evolve(p, stop_token_ids=stop))
    return new


@given(mix=mixes, data=st.data())
def test_async_steps_give_the_tokens_and_logprobs_of_sync_steps(llms, mix, data) -> None:
    prompts, params = [p for p, _ in mix], [sp for _, sp in mix]
    probe = generate(llms[False], prompts, params)
    picks = data.draw(st.lists(st.one_of(st.none(), st.integers(0, 9)), min_size=len(mix),
                               max_size=len(mix)))  # fmt: skip
    params = with_stops(params, probe, picks)
    want = generate(llms[False], prompts, params)
    got = generate(llms[True], prompts, params)
    assert_same_outputs(got, want)
    for out, p in zip(got, params, strict=True):
        stops = [i for i, t in enumerate(out.token_ids) if t in p.stop_token_ids]
        assert stops in ([], [len(out.token_ids) - 1]), "a token past a stop was returned"
        assert len(out.token_ids) <= p.max_tokens


def test_where_the_batches_coincide_the_logprobs_are_bit_identical(llms) -> None:
    """Every request seated from the first step, and a stop ending only the last one:
    asynchronous steps then run the same batches (a length limit is never scheduled
    past), so nothing but the trailing extra step differs."""
    prompts = [[5, 9, 13, 200], [33, 2], [7, 7, 7, 7, 8, 9, 10]]
    params = [SamplingParams(max_tokens=m, temperature=t, seed=3, logprobs=2, ignore_eos=True)
              for m, t in ((9, 0.0), (4, 0.9), (12, 0.0))]  # fmt: skip
    probe = generate(llms[False], prompts, params)[2].token_ids
    assert probe.index(probe[-1]) >= 9, "precondition: the stop ends it after the others"
    params[2] = attrs.evolve(params[2], stop_token_ids=(probe[-1],))
    want, got = generate(llms[False], prompts, params), generate(llms[True], prompts, params)
    assert [(o.token_ids, o.logprobs, o.top_logprobs) for o in got] == [
        (o.token_ids, o.logprobs, o.top_logprobs) for o in want
    ]


def test_the_small_pool_preempts_in_both_modes_and_gives_the_same_tokens(llms) -> None:
    prompts = [[7 + i] * 12 for i in range(3)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    before = {flag: llm.engine.scheduler.num_preemptions for flag, llm in llms.items()}
    want = generate(llms[False], prompts, [params] * 3)
    got = generate(llms[True], prompts, [params] * 3)
    assert_same_outputs(got, want)
    for flag, llm in llms.items():
        assert llm.engine.scheduler.num_preemptions > before[flag], "precondition: preempted"


def test_async_steps_are_the_default_on_the_cpu_too() -> None:
    assert EngineConfig.load(device="cpu").scheduler.async_scheduling is True


def test_placeholders_take_the_previous_steps_tokens_on_the_device() -> None:
    greedy = SamplingParams(temperature=0.0)
    step = step_of([
        Row(4, (PLACEHOLDER_TOKEN,), 9, (0, 1, 2), -1, True, greedy, 1),
        Row(5, (11, 12), 0, (3,), -1, False, greedy, 0),
        Row(2, (PLACEHOLDER_TOKEN,), 3, (4,), -1, True, greedy, 1),
    ])  # fmt: skip
    previous = DeviceTokens([2, 3, 4], torch.tensor([20, 30, 40]))
    assert placeholder_rows(step, previous) == ([0, 3], [2, 0])
    input_ids = torch.tensor([PLACEHOLDER_TOKEN, 11, 12, PLACEHOLDER_TOKEN, 0])
    feed_placeholders(input_ids, step, previous)
    assert input_ids.tolist() == [40, 11, 12, 20, 0]
    with pytest.raises(RuntimeError, match="sequence 4 feeds the token it sampled"):
        placeholder_rows(step, DeviceTokens([2], torch.tensor([20])))


def test_a_decode_in_the_last_steps_order_takes_its_tokens_in_one_copy() -> None:
    greedy = SamplingParams(temperature=0.0)
    step = step_of([Row(sid, (PLACEHOLDER_TOKEN,), 5, (sid,), -1, True, greedy, 1)
                    for sid in (7, 3)])  # fmt: skip
    input_ids = torch.full((4,), PLACEHOLDER_TOKEN)
    feed_placeholders(input_ids, step, DeviceTokens([7, 3], torch.tensor([70, 30])))
    assert input_ids.tolist() == [70, 30, PLACEHOLDER_TOKEN, PLACEHOLDER_TOKEN]
