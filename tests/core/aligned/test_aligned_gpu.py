"""Trainer-aligned mode on CUDA at the Qwen3-0.6B shape in bf16 (random weights): the
engine samples with deterministic mode's Triton kernels, chunked prefill and decode
graphs; the trainer's transformers model, aligned, gives every sampled and prompt
token the engine's logprob bit for bit, in one left-padded batch and each sample
alone, including a prompt whose keys cross the attention's 1,024-key split; and the
gradient flows."""

from __future__ import annotations

import pytest
import torch

from kvrunner import LLM, SamplingParams
from kvrunner.aligned import align, token_logprobs

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

ENGINE = dict(dtype="bfloat16", deterministic=True, max_num_seqs=16, max_model_len=1536,
              max_num_batched_tokens=512, gpu_memory_utilization=0.4)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    lengths = [3, 17, 200, 64, 1100, 1]
    return [torch.randint(10, 5000, (n,), generator=g).tolist() for n in lengths]


def test_the_aligned_trainer_gives_the_engines_logprobs_on_the_gpu(qwen3_0_6b) -> None:
    batch = prompts()
    with LLM(str(qwen3_0_6b), **ENGINE) as llm:
        params = [SamplingParams(max_tokens=24, temperature=1.0, seed=i, logprobs=0,
                                 prompt_logprobs=0, ignore_eos=True) for i in range(len(batch))]
        outs = llm.generate(batch, params)
        config = llm.config
    model = transformers.AutoModelForCausalLM.from_pretrained(
        qwen3_0_6b, dtype=torch.bfloat16).cuda()
    align(model, config)
    sequences = [p + list(o.token_ids) for p, o in zip(batch, outs, strict=True)]
    wants = [torch.tensor(o.prompt_logprobs[1:] + o.logprobs, dtype=torch.float32,
                          device="cuda") for o in outs]
    width = max(map(len, sequences))
    ids = torch.zeros(len(sequences), width, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq):] = torch.tensor(seq)
        mask[row, width - len(seq):] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits
    total = 0
    for row, (seq, want) in enumerate(zip(sequences, wants, strict=True)):
        first = width - len(seq)
        got = token_logprobs(logits[row, first : width - 1], ids[row, first + 1 :])
        gap = (got.detach() - want).abs()
        assert torch.equal(got.detach(), want), (
            f"sample {row} ({len(seq)} tokens): {int((gap > 0).sum())} differ, max {gap.max():.3g}")
        total = total + got.sum()
    total.backward()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    with torch.no_grad():
        for seq, want in zip(sequences, wants, strict=True):
            alone = model(input_ids=torch.tensor([seq], device="cuda")).logits[0, :-1]
            assert torch.equal(token_logprobs(alone, torch.tensor(seq[1:], device="cuda")), want)
