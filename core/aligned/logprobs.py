"""Token logprobs from logits, by the engine's sampler's own call."""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[..., token]`` for logits ``[..., V]`` and ``tokens``
    ``[...]``: float32, as the engine's sampler reports a sampled token's raw logprob
    (``layers/sampler.py``: ``log_softmax(logits, dim=-1, dtype=torch.float32)``), so an
    aligned model's logits give the engine's logprobs to the bit."""
    scores = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    return scores.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
