"""On CUDA (bf16, decode graphs, asynchronous steps): the token masks go up and apply on
the device as xgrammar's own CUDA kernel applies them, every constrained output is one
its grammar accepts, and the steps of a batch without a constrained request stay
drawn in the decode graph.

The CPU suite covers what the code does (``test_structured_outputs_generate.py``); this
file, that the pinned uploads, the unpacking on the device and the graphs' eager
fallback hold on the device's kernels.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from kvrunner import LLM, SamplingParams
from kvrunner.engine.token_masks import TokenMasks, mask_width
from kvrunner.layers.token_mask import masked_logits

pytestmark = pytest.mark.gpu
xgr = pytest.importorskip("xgrammar")

ENGINE = dict(max_num_seqs=16, max_model_len=256, block_size=16, gpu_memory_utilization=0.3)
REGEX = "[0-9]{3}-[a-z]{2,4}"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                  "maximum": 999}},
          "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-qwen3", **ENGINE) as llm:
        assert llm.runner.device.type == "cuda" and llm.engine.async_scheduling
        yield llm


def test_masks_on_the_device_match_xgrammars_cuda_application() -> None:
    rng = np.random.default_rng(0)
    vocab, n = 151_936, 8
    rows = np.array([0, 3, 4, 7])
    bits = rng.integers(-(2**31), 2**31, (len(rows), mask_width(vocab))).astype(np.int32)
    logits = torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16)
    want = logits.clone()
    full = torch.full((n, mask_width(vocab)), -1, dtype=torch.int32, device="cuda")
    full[torch.from_numpy(rows).cuda()] = torch.from_numpy(bits).cuda()
    xgr.apply_token_bitmask_inplace(want, full)
    assert torch.equal(masked_logits(logits, TokenMasks(rows, bits)), want)


def test_constrained_outputs_hold_and_plain_ones_are_unaffected(llm) -> None:
    plain = SamplingParams(max_tokens=32, temperature=1.0, seed=7, ignore_eos=True)
    prompts = [[5, 17, 42, 9]] * 5
    constrained = [
        SamplingParams(max_tokens=64, temperature=1.0, seed=1, structured_outputs={"regex": REGEX}),
        SamplingParams(max_tokens=64, temperature=0.7, seed=2, structured_outputs={
            "json": SCHEMA, "disable_any_whitespace": True}),
        SamplingParams(max_tokens=16, temperature=1.0, seed=3,
                       structured_outputs={"choice": ["yes", "no"]}),
        SamplingParams(max_tokens=64, temperature=0.0, structured_outputs={"regex": REGEX})]
    outs = llm.generate(prompts, [*constrained, plain])
    assert re.fullmatch(REGEX, outs[0].text) and re.fullmatch(REGEX, outs[3].text)
    assert set(json.loads(outs[1].text)) == {"n"}
    assert outs[2].text in ("yes", "no")
    assert all(o.finish_reason == "stop" for o in outs[:4])


def test_a_plain_request_beside_constrained_ones_gets_its_tokens_alone() -> None:
    # deterministic mode: bf16 products batch-invariant, so alone and beside compare
    # bit for bit; beside constrained rows its steps are synchronous and sampled eagerly
    plain = SamplingParams(max_tokens=32, temperature=1.0, seed=7, ignore_eos=True,
                           logprobs=1)
    with LLM("tiny-qwen3", **ENGINE, deterministic=True) as llm:
        alone = llm.generate([[9, 8, 7, 6]], plain)[0]
        beside = llm.generate([[5, 17, 42], [9, 8, 7, 6], [5, 17, 42]], [
            SamplingParams(max_tokens=48, temperature=1.0, seed=1,
                           structured_outputs={"regex": REGEX}),
            plain,
            SamplingParams(max_tokens=8, temperature=0.0,
                           structured_outputs={"choice": ["yes", "no"]})])[1]
    assert beside.token_ids == alone.token_ids and beside.logprobs == alone.logprobs
