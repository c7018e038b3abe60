"""On CUDA: launching a step - preparation, placeholders, replay, sampler, the copy of
its samples to the host - never makes the host wait for the device, so the host can
schedule the next step while this one runs. Only ``result()`` waits, for its step.

The CPU suite covers what the code does; this file, whether it lets the host run
ahead on a real device, and that async and synchronous steps give the same tokens there.
"""

from __future__ import annotations

import pytest
import torch

from kvrunner import LLM, SamplingParams
from kvrunner.models.tiny import write_tiny_checkpoint

pytestmark = pytest.mark.gpu

MIX = [
    SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.8, top_k=20, top_p=0.9, seed=7, logprobs=0),
    SamplingParams(max_tokens=7, temperature=1.0, ignore_eos=True),  # unseeded
]
#: no row filters by top-k / top-p: the decode graph draws them (greedy, seeded, and
#: unseeded rows keyed by the engine), from temperatures and keys each step uploads
#: (graph_sampling.py)
DRAWN_IN_GRAPH = [
    SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.8, seed=7, logprobs=0, ignore_eos=True),
    SamplingParams(max_tokens=7, temperature=1.2, ignore_eos=True),  # unseeded
]
PROMPTS = [[3, 17, 29, 101], [7, 8, 9, 10, 11], [200]]


@pytest.mark.parametrize("mix", [MIX, DRAWN_IN_GRAPH], ids=["eager-draws", "graph-draws"])
@pytest.mark.parametrize("kind", ["qwen3", "qwen3-next"])
def test_launching_a_step_makes_the_host_wait_for_nothing(tmp_path, kind: str, mix) -> None:
    path = write_tiny_checkpoint(tmp_path / kind, kind=kind)
    with LLM(model=str(path), max_num_seqs=4, max_model_len=64, gpu_memory_utilization=0.3) as llm:
        _check_launches_wait_for_nothing(llm, mix)


def _check_launches_wait_for_nothing(llm: LLM, mix: list[SamplingParams]) -> None:
    assert llm.runner.device.type == "cuda" and llm.engine.async_scheduling
    want = llm.generate(PROMPTS, mix)  # first launches may initialise libraries: not checked
    launch = llm.runner.launch
    launched = []

    def strict_launch(step):
        torch.cuda.set_sync_debug_mode("error")  # any host wait for the device raises
        try:
            launched.append(step)
            return launch(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    llm.runner.launch = strict_launch
    got = llm.generate(PROMPTS, mix)
    assert any(-1 in t for step in launched for t in step.token_ids), "placeholders were fed"
    # Greedy and seeded rows repeat; an unseeded row is a new request with a new key.
    assert [o.token_ids for o in got][:2] == [o.token_ids for o in want][:2]


@pytest.mark.parametrize("kind", ["qwen3", "qwen3-next"])
def test_seeded_and_greedy_tokens_are_those_of_synchronous_steps(tmp_path, kind: str) -> None:
    path = str(write_tiny_checkpoint(tmp_path / kind, kind=kind))
    prompts = [[5 + i, 6, 7 + 2 * i, 8] * (1 + i % 3) for i in range(12)]
    params = [
        SamplingParams(max_tokens=10 + i % 4, temperature=0.9, top_p=0.95, seed=i, logprobs=1)
        if i % 2 else SamplingParams(max_tokens=9, temperature=0.0, stop_token_ids=[17])
        for i in range(12)
    ]
    # Unseeded rows are keyed by the engine's seed and their request ids, which both
    # engines give alike: they too must draw the same tokens.
    params[4] = params[8] = SamplingParams(max_tokens=9, temperature=1.0)
    got = {}
    for mode in (True, False):
        with LLM(model=path, max_num_seqs=8, max_model_len=64, gpu_memory_utilization=0.3,
                 async_scheduling=mode) as llm:
            got[mode] = [o.token_ids for o in llm.generate(prompts, params)]
    assert got[True] == got[False]
