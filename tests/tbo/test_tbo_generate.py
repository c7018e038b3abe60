"""Two-batch overlap end to end: the tokens and logprobs of the engine without it,
on both model families, through captured graphs, across sleep and wake, and on two
tensor-parallel ranks; a capture writes nothing through its mirrors."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvrunner_tbo import TwoBatchOverlap

from kvrunner import LLM, SamplingParams
from kvrunner.models.tiny import write_tiny_checkpoint
from kvrunner.plugin_api import CacheWriteTarget, hookimpl
from kvrunner.plugin_host.plugins import register_backend, unregister_backend
from kvrunner.runner.capture.capture_safety import CaptureAuditError

#: cut every step with two or more rows, so even tiny batches take the overlap path
EAGER_SPLIT = dict(overlap_min_tokens=2, overlap_min_decode_seqs=2)
SMALL = dict(max_num_seqs=4, max_model_len=96, capture_sizes=(2, 4))
KINDS = ["tiny-qwen3", "tiny-qwen3-next"]


def _count_splits(llm: LLM) -> list[int]:
    """Wrap the runner's overlap plugin so every step it cut is counted."""
    overlap = llm.executor.runner.backends.overlap
    plan, splits = overlap.plan, []

    def counted(step, layers):
        parts = plan(step, layers)
        splits.append(int(parts is not None))
        return parts

    overlap.plan = counted
    return splits


@pytest.fixture(scope="module", params=KINDS)
def pair(request) -> Iterator[tuple[LLM, LLM, list[int]]]:
    """The same model with and without two-batch overlap, graphs captured."""
    plain = LLM(request.param, **SMALL)
    tbo = LLM(request.param, overlap="tbo", **EAGER_SPLIT, **SMALL)
    yield plain, tbo, _count_splits(tbo)
    plain.shutdown()
    tbo.shutdown()


prompts = st.lists(st.lists(st.integers(1, 400), min_size=1, max_size=40), min_size=1,
                   max_size=6)


@settings(max_examples=4)
@given(prompts=prompts, max_tokens=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_generation_with_two_batch_overlap_equals_generation_without(
    pair, prompts, max_tokens, seed
) -> None:
    plain, tbo, splits = pair
    splits.clear()
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed, ignore_eos=True)
    for params in (greedy, seeded):
        want = plain.generate(prompts, params)
        got = tbo.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g.logprobs or [], w.logprobs or [], strict=True):
            assert a.keys() == b.keys()
            torch.testing.assert_close(list(a.values()), list(b.values()), rtol=1e-4, atol=1e-4)
    if sum(map(len, prompts)) >= 2:  # the first step has two rows to cut
        assert sum(splits) > 0


@pytest.mark.parametrize("kind", ["qwen3", "qwen3-next"])
def test_two_ranks_with_overlap_generate_what_one_rank_without_does(tmp_path, kind) -> None:
    ckpt = str(write_tiny_checkpoint(tmp_path / kind, kind=kind, seed=5))
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18, 19, 20, 21, 22], [7]]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    with LLM(ckpt, enforce_eager=True, **SMALL) as one:
        want = [o.token_ids for o in one.generate(prompts, params)]
    with LLM(ckpt, tensor_parallel_size=2, overlap="tbo", **EAGER_SPLIT, **SMALL) as two:
        got = [o.token_ids for o in two.generate(prompts, params)]
    assert got == want


def test_sleep_and_wake_with_overlap_lose_nothing() -> None:
    prompts = [[3, 4, 5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20, 21]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM("tiny-qwen3-next", overlap="tbo", **EAGER_SPLIT, **SMALL) as llm:
        splits = _count_splits(llm)
        first = [o.token_ids for o in llm.generate(prompts, params)]
        for level in (1, 2, 1):
            llm.sleep(level=level)
            llm.wake_up()
            assert [o.token_ids for o in llm.generate(prompts, params)] == first
        assert sum(splits) > 0


def _serve_then_recapture(**capture) -> int:
    """Serve a batch, then recapture under the audit; the graphs captured."""
    prompts = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14], [15, 16]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM("tiny-qwen3", overlap="tbo", audit=True, **EAGER_SPLIT, **SMALL, **capture) as llm:
        llm.generate(prompts, params)  # the mirrors now hold a served batch's slots
        llm.recapture()  # raises CaptureAuditError if any capture wrote a pool byte
        return len(llm.runner.graph_capture.graphs)


def test_a_capture_after_serving_writes_nothing_through_the_mirrors() -> None:
    assert _serve_then_recapture() == 2  # sizes 2 and 4 recaptured, the audit passed


def test_without_blanking_the_mirrors_a_served_batch_is_overwritten() -> None:
    """Every graph here is cut (sizes 2 and 4), so what it writes goes through mirrors."""
    with pytest.raises(CaptureAuditError, match="wrote into cache pool"):
        _serve_then_recapture(blank_write_targets=False)


class ForgetsAMirror(TwoBatchOverlap):
    """Declares every mirror but part 1's copy of paged's slot mapping."""

    @hookimpl
    def cache_write_targets(self) -> list[CacheWriteTarget]:
        """The plugin's targets, minus one."""
        return [t for t in super().cache_write_targets() if t.name != "part1.paged.slot_mapping"]


def test_an_undeclared_mirror_is_caught_by_the_audit_at_the_first_capture() -> None:
    register_backend("tbo-forgetful", ForgetsAMirror)
    try:
        with pytest.raises(CaptureAuditError, match="wrote into cache pool"):
            LLM("tiny-qwen3", overlap="tbo-forgetful", audit=True, **EAGER_SPLIT, **SMALL)
    finally:
        unregister_backend("tbo-forgetful")
