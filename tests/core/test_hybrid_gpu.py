"""Qwen3-Next on CUDA (Triton GDN + paged kernels, CUDA graphs) repeats the CPU path.

The CPU path matches transformers token for token (test_hybrid_generate.py), so the
GPU matching the CPU ties it to transformers too, whatever transformers version the
GPU machine has. fp32 so rounding cannot flip a greedy choice.
"""

from __future__ import annotations

import pytest
import torch

from kvrunner import LLM, SamplingParams
from kvrunner.models.tiny import write_tiny_checkpoint

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SETTINGS = dict(dtype="float32", max_num_seqs=8, max_model_len=160, num_blocks=256, audit=True)


@pytest.fixture(scope="module")
def tiny_next(tmp_path_factory) -> str:
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "n", kind="qwen3-next"))


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    lengths = (1, 5, 17, 64, 73, 9, 30)  # around and past the 64-token GDN chunk
    return [torch.randint(1, 400, (n,), generator=g).tolist() for n in lengths]


def test_cuda_graphs_and_triton_kernels_match_the_cpu_path(tiny_next) -> None:
    cpu = LLM(model=tiny_next, device="cpu", enforce_eager=True, **SETTINGS)
    gpu = LLM(model=tiny_next, device="cuda", **SETTINGS)
    captured = gpu.runner.graph_capture.graphs
    assert captured and all(g._graph is not None for g in captured.values())
    expected = [o.token_ids for o in cpu.generate(prompts(), GREEDY)]
    assert [o.token_ids for o in gpu.generate(prompts(), GREEDY)] == expected
    gpu.recapture()  # after serving: audit raises if a KV or state pool changed
    assert [o.token_ids for o in gpu.generate(prompts(), GREEDY)] == expected
    assert gpu.runner.launcher.nan_rows == 0


def test_chunked_prefill_on_cuda_matches(tiny_next) -> None:
    cpu = LLM(model=tiny_next, device="cpu", enforce_eager=True, **SETTINGS)
    gpu = LLM(model=tiny_next, device="cuda", max_num_batched_tokens=24, **SETTINGS)
    assert [o.token_ids for o in gpu.generate(prompts(), GREEDY)] == [
        o.token_ids for o in cpu.generate(prompts(), GREEDY)
    ]
