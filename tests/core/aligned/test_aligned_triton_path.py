"""The aligned forward on the engine's Triton kernels (the GPU's path, run here by the
Triton interpreter under ``[kernels] triton_on_cpu``): the fused norms, the fused
q/k norm and rotary, the activation, the invariant GEMM, the top-k routing, the
grouped experts with deterministic mode's tiling and the fixed-order attention
kernel give the trainer the engine's logprobs bit for bit, close to transformers'
own forward, and the gradient still flows (through the plain-torch references). On
this path the norms and the activation matter too: left on transformers' torch
code, each breaks the equality.

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


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe"])
def triton_rollout(request, tmp_path_factory) -> tuple:
    """A checkpoint, and the engine's samples and config on the Triton path."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param) / "m",
                                 kind=request.param)
    llm = LLM(str(path), dtype="float32", deterministic=True, triton_on_cpu=True,
              enforce_eager=True, block_size=4, max_num_batched_tokens=8)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=1.0, seed=3,
                                                    logprobs=0, ignore_eos=True))
        return path, outs, llm.config
    finally:
        llm.shutdown()


def padded(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and their mask."""
    width = max(map(len, sequences))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    return ids, mask


def sampled_logprobs(model, outs, ids, mask) -> list[torch.Tensor]:
    logits = model(input_ids=ids, attention_mask=mask).logits
    return [token_logprobs(logits[row, len(p) - 1 : len(p) - 1 + len(o.token_ids)],
                           torch.tensor(o.token_ids))
            for row, (p, o) in enumerate(zip(PROMPTS, outs, strict=True))]


def test_the_triton_path_gives_the_engines_logprobs_and_a_gradient(triton_rollout) -> None:
    path, outs, config = triton_rollout
    model = align(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                  config)
    plain = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids, mask = padded([p + list(o.token_ids) for p, o in zip(PROMPTS, outs, strict=True)])
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask).logits
        theirs = plain(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(ours[mask.bool()], theirs[mask.bool()], atol=1e-4, rtol=0)
    got = sampled_logprobs(model, outs, ids, mask)
    for logprobs, out in zip(got, outs, strict=True):
        assert torch.equal(logprobs.detach(), torch.tensor(out.logprobs, dtype=torch.float32))
    sum(g.sum() for g in got).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("op", ["norm", "activation"])
def test_on_triton_the_norms_and_the_activation_must_be_the_engines(triton_rollout, op) -> None:
    path, outs, config = triton_rollout
    if op == "activation" and "moe" in path.parent.name:
        pytest.skip("the tiny MoE's sparse layers have no dense activation to leave out")
    model = align(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                  config, transformers_ops=[op])
    ids, mask = padded([p + list(o.token_ids) for p, o in zip(PROMPTS, outs, strict=True)])
    with torch.no_grad():
        got = sampled_logprobs(model, outs, ids, mask)
    assert any(not torch.equal(g, torch.tensor(o.logprobs, dtype=torch.float32))
               for g, o in zip(got, outs, strict=True))
