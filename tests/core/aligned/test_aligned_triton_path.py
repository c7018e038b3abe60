"""The aligned forward on the engine's Triton kernels (the GPU's path, run here by the
Triton interpreter under ``[kernels] triton_on_cpu``): the fused norms, the fused
q/k norm and rotary, the activation, the invariant GEMM, the top-k routing, the
grouped experts with deterministic mode's tiling and the fixed-order attention
kernel give the trainer the engine's logprobs bit for bit, close to transformers'
own forward, and the gradient still flows (through the plain-torch references).

Float32: the interpreter's bf16 products are wrong (the invariant GEMM's bf16 result
is 9e10 off transformers' on random inputs here), so a bf16 comparison would compare
two wrong numbers; bf16 on the real kernels is ``test_aligned_gpu.py``'s."""

from __future__ import annotations

import pytest
import torch

from kvrunner import LLM, SamplingParams
from kvrunner.aligned import align, token_logprobs
from kvrunner.models.tiny import write_tiny_checkpoint

transformers = pytest.importorskip("transformers")

PROMPTS = [[3, 17, 29, 101, 55, 66], [7, 8, 9]]


@pytest.mark.parametrize("kind", ["qwen3", "qwen3-moe"])
def test_the_triton_path_gives_the_engines_logprobs_and_a_gradient(tmp_path, kind) -> None:
    path = write_tiny_checkpoint(tmp_path / kind, kind=kind)
    llm = LLM(str(path), dtype="float32", deterministic=True, triton_on_cpu=True,
              enforce_eager=True, block_size=4, max_num_batched_tokens=8)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=1.0, seed=3,
                                                    logprobs=0, ignore_eos=True))
        config = llm.config
    finally:
        llm.shutdown()
    model = align(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                  config)
    plain = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sequences = [p + list(o.token_ids) for p, o in zip(PROMPTS, outs, strict=True)]
    width = max(map(len, sequences))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    logits = model(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad():
        theirs = plain(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits.detach()[mask.bool()], theirs[mask.bool()],
                               atol=1e-4, rtol=0)
    total = 0
    for row, (prompt, out) in enumerate(zip(PROMPTS, outs, strict=True)):
        rows = logits[row, len(prompt) - 1 : len(prompt) - 1 + len(out.token_ids)]
        got = token_logprobs(rows, torch.tensor(out.token_ids))
        assert torch.equal(got.detach(), torch.tensor(out.logprobs, dtype=torch.float32))
        total = total + got.sum()
    total.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
