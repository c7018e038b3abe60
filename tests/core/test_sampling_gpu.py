"""On CUDA (bf16, decode graphs, asynchronous steps): the n samples of a prompt share
its KV through the prefix cache and draw what single requests draw; stop strings end
a request with the stop text and every later token left out.

The CPU suite covers what the code does; this file, that a prefix-cache hit's prefill
(its prompt's KV read from cached blocks rather than computed in the same pass) gives
the tokens a full prefill gives on the device's kernels too.
"""

from __future__ import annotations

import pytest

from kvrunner import LLM, SamplingParams

pytestmark = pytest.mark.gpu

ENGINE = dict(max_num_seqs=16, max_model_len=128, block_size=16, gpu_memory_utilization=0.3)
PROMPTS = [[(7 * i + 3) % 400 + 1 for i in range(40)], [(5 * i + 1) % 400 + 1 for i in range(37)]]


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-qwen3", **ENGINE) as llm:
        assert llm.runner.device.type == "cuda" and llm.engine.async_scheduling
        yield llm


def test_samples_share_the_prompt_and_draw_as_single_requests(llm) -> None:
    params = SamplingParams(n=4, seed=3, max_tokens=12, ignore_eos=True, temperature=1.0)
    llm.reset_prefix_cache()
    before = llm.cache_info().prefix_hit_tokens
    outs = llm.generate(PROMPTS, params)
    hits = llm.cache_info().prefix_hit_tokens - before
    assert hits == 3 * sum((len(p) - 1) // 16 * 16 for p in PROMPTS)
    # the same batch of single requests, every prompt prefilled in full (bf16 kernels
    # are not batch invariant, so the batch is the same one)
    llm.reset_prefix_cache()
    singles = llm.generate([p for p in PROMPTS for _ in range(4)],
                           [params.for_sample(k) for _ in PROMPTS for k in range(4)])
    assert llm.cache_info().prefix_hit_tokens - before == hits  # no sharing among singles
    assert [o.token_ids for o in outs] == [o.token_ids for o in singles]
    assert len({tuple(o.token_ids) for o in outs[:4]}) == 4


def test_stop_strings_under_graphs_and_async_steps(llm) -> None:
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=1)
    plain = llm.generate("The river was", greedy)[0]
    stop = plain.text[9:12]
    text = ""
    for k in range(1, len(plain.token_ids) + 1):
        text = llm.tokenizer.decode(plain.token_ids[:k], skip_special_tokens=True)
        if stop in text and not text.endswith("\ufffd"):
            break
    out = llm.generate(["The river was", "The river was"],
                       [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                       logprobs=1, stop=stop), greedy])
    assert (out[0].finish_reason, out[0].stop_reason) == ("stop", stop)
    assert out[0].token_ids == plain.token_ids[:k]
    assert out[0].text == text[: text.find(stop)]
    assert out[1].token_ids == plain.token_ids  # its neighbour's stop changed nothing
