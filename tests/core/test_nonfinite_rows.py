"""A non-finite logits row is reported, never sampled.

For the tiny Qwen3 with NaN or inf planted in a random tensor (pushed with
``update_weights``, and once written into the checkpoint itself), with asynchronous
steps and without: no request returns a token drawn from a non-finite row (every
returned logprob is finite), and every request that hit one ends with finish reason
``"error"`` and an error naming its step and cause. With NaN in one embedding row,
exactly the requests that feed that token fail, each at the step that feeds it, and
the rest of the batch gets exactly the tokens it gets without the fault.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvrunner import LLM, NonFiniteLogitsError, SamplingParams
from kvrunner.config import ConfigError, EngineConfig
from kvrunner.layers.nonfinite_rows import mark_nonfinite
from kvrunner.models.tiny import write_tiny_checkpoint

SMALL = dict(max_num_seqs=3, max_model_len=64, block_size=4, num_blocks=64)
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0, ignore_eos=True)
ERROR = re.compile(
    r"step \d+ \(output token \d+\): "
    r"(logits hold NaN|logits hold \+inf|every logit is -inf)"
)
EMBED = "model.embed_tokens.weight"


def test_a_request_ended_by_a_nonfinite_row_keeps_one_kept_mass_per_token(llm, clean) -> None:
    """The failing row's kept mass is dropped with its token."""
    params = SamplingParams(max_tokens=5, temperature=0.8, top_k=3, seed=1, ignore_eos=True,
                            return_kept_mass=True)  # fmt: skip
    reference = llm.generate([[5, 6, 7]], params)[0]
    poisoned = clean[EMBED].clone()
    poisoned[reference.token_ids[1]] = float("nan")  # fed by the third step
    push(llm, EMBED, poisoned)
    try:
        out = llm.generate([[5, 6, 7]], params)[0]
    finally:
        push(llm, EMBED, clean[EMBED])
    assert out.finish_reason == "error"
    assert out.token_ids == reference.token_ids[:2]
    assert out.kept_mass == reference.kept_mass[:2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("nonfinite") / "m")


@pytest.fixture(scope="module")
def clean(checkpoint) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(checkpoint / "model.safetensors"))


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request, checkpoint) -> Iterator[LLM]:
    engine = LLM(str(checkpoint), async_scheduling=request.param, **SMALL)
    yield engine
    engine.shutdown()


def push(llm: LLM, name: str, tensor: torch.Tensor) -> None:
    """Push one tensor, past the finiteness refusal where ``update_weights`` has one."""
    takes = inspect.signature(llm.update_weights).parameters
    extra = {"check_finite": False} if "check_finite" in takes else {}
    llm.update_weights([(name, tensor)], **extra)


def assert_nothing_sampled_from_a_nonfinite_row(outs) -> int:
    """Every returned logprob is finite (a NaN / inf / all -inf row has none), and
    every request ended by such a row says so; returns how many were."""
    failed = 0
    for out in outs:
        assert len(out.logprobs) == len(out.token_ids)
        assert all(math.isfinite(lp) for lp in out.logprobs), out
        if out.finish_reason == "error":
            assert out.error is not None and ERROR.fullmatch(out.error), out.error
            failed += 1
        else:
            assert out.error is None
    return failed


prompts = st.lists(st.lists(st.integers(3, 60), min_size=1, max_size=6), min_size=1, max_size=4)


@given(
    name=st.sampled_from(["lm_head.weight", EMBED, "model.norm.weight",
                          "model.layers.0.self_attn.k_proj.weight",
                          "model.layers.1.mlp.down_proj.weight",
                          "model.layers.0.input_layernorm.weight"]),
    value=st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    where=st.floats(0.0, 1.0, exclude_max=True),
    batch=prompts,
)
def test_no_request_returns_a_token_from_a_nonfinite_row(llm, clean, name, value, where,
                                                         batch) -> None:  # fmt: skip
    poisoned = clean[name].clone()
    flat = poisoned.view(-1)
    flat[int(where * flat.numel())] = value
    before = llm.cache_info().nonfinite_rows
    push(llm, name, poisoned)
    try:
        outs = llm.generate(batch, GREEDY)
    finally:
        push(llm, name, clean[name])
    failed = assert_nothing_sampled_from_a_nonfinite_row(outs)
    assert llm.cache_info().nonfinite_rows - before == failed


@given(
    batch=st.lists(st.lists(st.integers(3, 40), min_size=1, max_size=5), min_size=2,
                   max_size=4),
    bad=st.integers(3, 40),
)
def test_nan_in_one_embedding_row_fails_only_the_requests_that_feed_it(llm, clean, batch,
                                                                        bad) -> None:  # fmt: skip
    reference = llm.generate(batch, GREEDY)
    poisoned = clean[EMBED].clone()
    poisoned[bad] = float("nan")
    push(llm, EMBED, poisoned)
    try:
        outs = llm.generate(batch, GREEDY)
    finally:
        push(llm, EMBED, clean[EMBED])
    assert_nothing_sampled_from_a_nonfinite_row(outs)
    for prompt, ref, out in zip(batch, reference, outs, strict=True):
        fed = list(prompt) + ref.token_ids[:-1]  # every token a step feeds
        if bad not in fed:
            assert (out.token_ids, out.finish_reason) == (ref.token_ids, ref.finish_reason)
            assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
            continue
        # The row after feeding ``bad`` is the first non-finite one: the tokens before
        # it stand, nothing from it or after.
        first = max(fed.index(bad) - len(prompt) + 1, 0)
        assert out.finish_reason == "error"
        assert out.token_ids == ref.token_ids[:first]
        assert out.error.endswith(f"(output token {first}): logits hold NaN")


def test_nan_written_into_the_checkpoint_ends_every_request_with_an_error(tmp_path) -> None:
    path = write_tiny_checkpoint(tmp_path / "m")
    tensors = safetensors.torch.load_file(str(path / "model.safetensors"))
    tensors["model.norm.weight"][7] = float("nan")
    safetensors.torch.save_file(tensors, str(path / "model.safetensors"))
    # check_finite (on by default) would refuse this checkpoint at start-up
    with LLM(str(path), check_finite=False, **SMALL) as llm:
        outs = llm.generate([[5, 6, 7], [8, 9]], GREEDY)
        assert [(o.token_ids, o.finish_reason) for o in outs] == [([], "error")] * 2
        assert all(o.error.endswith("(output token 0): logits hold NaN") for o in outs)
        assert llm.cache_info().nonfinite_rows == 2


def test_nonfinite_raise_names_the_requests_and_leaves_the_engine_usable(
    checkpoint, clean
) -> None:
    with LLM(str(checkpoint), nonfinite="raise", **SMALL) as llm:
        reference = llm.generate([[5, 6, 7], [11, 12]], GREEDY)
        poisoned = clean[EMBED].clone()
        poisoned[9] = float("nan")
        push(llm, EMBED, poisoned)
        with pytest.raises(NonFiniteLogitsError, match=r"request \d+: step \d+ .*NaN") as err:
            llm.generate([[5, 6, 7], [8, 9, 10], [11, 12]], GREEDY)
        assert len(err.value.errors) == 1
        assert not llm.engine.has_unfinished()
        push(llm, EMBED, clean[EMBED])
        again = llm.generate([[5, 6, 7], [11, 12]], GREEDY)
        assert [o.token_ids for o in again] == [o.token_ids for o in reference]


def test_nonfinite_is_validated() -> None:
    with pytest.raises(ConfigError, match="nonfinite"):
        EngineConfig.load(None, nonfinite="ignore")


def test_the_cause_is_read_from_each_rows_own_maximum() -> None:
    tokens = torch.tensor([7, 8, 9, 10, 11])
    row_max = torch.tensor([1.0, float("nan"), float("inf"), float("-inf"), -3.0])
    coded, count = mark_nonfinite(tokens, row_max)
    assert coded.tolist() == [7, -2, -3, -4, 11]
    assert int(count) == 3
