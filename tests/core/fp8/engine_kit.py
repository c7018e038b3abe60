"""What the FP8 engine tests (dense and experts) look at: greedy answers, the stored
FP8 bytes and scales, and where the parameters live."""

from __future__ import annotations

import torch

from kvrunner import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)


def answers(llm: LLM) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their logprobs."""
    return [(o.token_ids, list(o.logprobs)) for o in llm.generate(PROMPTS, GREEDY)]


def fp8_state(llm: LLM) -> dict[str, torch.Tensor]:
    """Every FP8 weight's bytes and every scale (a linear's ``weight_scale_inv``, the
    experts' ``w13_scale_inv`` / ``w2_scale_inv``), by parameter name."""
    return {n: (p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p).clone()
            for n, p in llm.runner.model.named_parameters()
            if p.dtype == torch.float8_e4m3fn or n.endswith("scale_inv")}


def pointers(llm: LLM) -> dict[str, int]:
    """Each parameter's storage address (a push must rewrite, not replace)."""
    return {n: p.data_ptr() for n, p in llm.runner.model.named_parameters()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
