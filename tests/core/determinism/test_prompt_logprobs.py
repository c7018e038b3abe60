"""Prompt logprobs: each prompt token's logprob (and top-k) from the prefill, shaped as
vLLM returns them (None for the first token), against transformers' own forward in
float32 on the embedded tiny checkpoints."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvrunner import LLM, AsyncLLM, SamplingParams
from kvrunner.errors import RequestError
from kvrunner.models.tiny import write_tiny_checkpoint

transformers = pytest.importorskip("transformers")

PROMPTS = [
    [3, 17, 29, 101, 55, 66, 77, 88, 99, 5, 6, 7, 8, 40, 41, 42, 43, 44, 45],
    [7, 8, 9, 10, 11],
    [200, 201],
    [3, 17, 29, 101, 55, 66, 77, 88, 12, 13],  # shares two blocks of 4 with the first
]
TOP = 3


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe"])
def checkpoint(request, tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp(request.param) / "m", kind=request.param)


@pytest.fixture(scope="module")
def reference(checkpoint) -> list[torch.Tensor]:
    """transformers' float32 log-softmax at every position of every prompt."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint,
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1)
                for p in PROMPTS]


def check_against(reference: list[torch.Tensor], outs) -> None:
    for prompt, ref, out in zip(PROMPTS, reference, outs, strict=True):
        assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(out.prompt_top_logprobs) == len(prompt)
        want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        got = torch.tensor(out.prompt_logprobs[1:])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        for pos, top in enumerate(out.prompt_top_logprobs[1:]):
            values, ids = ref[pos].topk(TOP)
            assert len(top) == TOP
            torch.testing.assert_close(torch.tensor(list(top.values())), values, atol=1e-4,
                                       rtol=0)
            # ids agree wherever the reference's values are not (near) tied
            gaps = (values[:-1] - values[1:]).tolist() + [1.0]
            for (got_id, want_id), gap in zip(zip(top, ids.tolist(), strict=True), gaps,
                                              strict=True):
                if gap > 1e-4:
                    assert got_id == want_id


@pytest.mark.parametrize("settings", [
    {"enforce_eager": True},
    {"max_num_batched_tokens": 6, "max_num_seqs": 3},  # chunked prefill, mixed steps
    {"block_size": 4, "max_num_batched_tokens": 5},  # a chunk ends inside a block
], ids=["whole", "chunked", "chunked-blocks"])
def test_prompt_logprobs_match_a_transformers_forward(checkpoint, reference, settings) -> None:
    llm = LLM(str(checkpoint), dtype="float32", **settings)
    try:
        params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
        check_against(reference, llm.generate(PROMPTS, params))
    finally:
        llm.shutdown()


def test_a_prompt_in_the_prefix_cache_is_recomputed_to_be_scored(checkpoint, reference) -> None:
    llm = LLM(str(checkpoint), dtype="float32", block_size=4, enable_prefix_caching=True)
    try:
        llm.generate(PROMPTS, SamplingParams(max_tokens=1))  # every prompt's blocks cached
        hits = llm.cache_info().prefix_hit_tokens
        params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
        check_against(reference, llm.generate(PROMPTS, params))
        assert llm.cache_info().prefix_hit_tokens == hits  # no cached block was taken
        llm.generate(PROMPTS, SamplingParams(max_tokens=1))
        assert llm.cache_info().prefix_hit_tokens > hits  # the others still hit
    finally:
        llm.shutdown()


def test_zero_top_prompt_logprobs_score_only_the_prompt_tokens(checkpoint, reference) -> None:
    llm = LLM(str(checkpoint), dtype="float32")
    try:
        out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        assert out.prompt_top_logprobs is None and out.logprobs is None
        want = reference[0][torch.arange(len(PROMPTS[0]) - 1), torch.tensor(PROMPTS[0][1:])]
        torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), want, atol=1e-4,
                                   rtol=0)
        plain = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1))[0]
        assert plain.prompt_logprobs is None and plain.prompt_top_logprobs is None
    finally:
        llm.shutdown()


def test_prompt_logprobs_above_max_logprobs_are_refused_naming_both(checkpoint) -> None:
    llm = LLM(str(checkpoint), dtype="float32", max_logprobs=2)
    try:
        with pytest.raises(RequestError, match=r"prompt_logprobs=3 exceeds max_logprobs=2"):
            llm.generate(PROMPTS[:1], SamplingParams(prompt_logprobs=3))
        with pytest.raises(RequestError, match="SamplingParams.prompt_logprobs must be >= 0"):
            SamplingParams(prompt_logprobs=-1)
    finally:
        llm.shutdown()


def test_async_llm_returns_prompt_logprobs(checkpoint, reference) -> None:
    async def run():
        async with AsyncLLM(str(checkpoint), dtype="float32", max_num_batched_tokens=6) as llm:
            params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
            return await asyncio.gather(*(llm.generate(p, params) for p in PROMPTS))

    check_against(reference, asyncio.run(run()))
