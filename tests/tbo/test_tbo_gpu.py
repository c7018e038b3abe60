"""Two-batch overlap on the GPU: two streams captured into the decode graphs give
the tokens of the engine without overlap, at TP=1 and at TP=2 (NCCL).

In float32: on CUDA ``dtype="auto"`` serves these checkpoints in bfloat16, where
splitting a batch legitimately re-rounds the cut sequence (its two parts are other
GEMM shapes and two prefill chunks), and this tiny random model's logits come in
steps of 1/64: its sequence 8 has two tokens tied exactly in bf16 without overlap, so
the token picked says nothing of the overlap. In float32 the parts agree to rounding
(on the CPU, 5e-7 in logprob) and equal tokens are the claim.
"""

from __future__ import annotations

import pytest
import torch

from kvrunner import LLM, SamplingParams
from kvrunner.models.tiny import write_tiny_checkpoint

pytestmark = pytest.mark.gpu
SPLIT_ALL = dict(overlap_min_tokens=2, overlap_min_decode_seqs=2)
PROMPTS = [[5 + i, 6, 7 + 2 * i, 8, 9] * (1 + i % 3) for i in range(16)]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["qwen3", "qwen3-next"])
def test_overlap_on_equals_off_under_graphs_on_one_gpu(tmp_path, kind) -> None:
    ckpt = str(write_tiny_checkpoint(tmp_path / kind, kind=kind, seed=2))
    common = dict(dtype="float32", max_num_seqs=16, max_model_len=128)
    with LLM(ckpt, **common) as off:
        want = [o.token_ids for o in off.generate(PROMPTS, PARAMS)]
    with LLM(ckpt, overlap="tbo", **SPLIT_ALL, **common) as on:
        assert [o.token_ids for o in on.generate(PROMPTS, PARAMS)] == want


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("kind", ["qwen3", "qwen3-next"])
def test_overlap_on_equals_off_under_graphs_at_tp2(tmp_path, kind) -> None:
    ckpt = str(write_tiny_checkpoint(tmp_path / kind, kind=kind, seed=2))
    common = dict(dtype="float32", tensor_parallel_size=2, max_num_seqs=16, max_model_len=128)
    with LLM(ckpt, **common) as off:
        want = [o.token_ids for o in off.generate(PROMPTS, PARAMS)]
    with LLM(ckpt, overlap="tbo", **SPLIT_ALL, **common) as on:
        assert [o.token_ids for o in on.generate(PROMPTS, PARAMS)] == want
