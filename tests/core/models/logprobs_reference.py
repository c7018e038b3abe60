"""A plain-torch reference of what each ``logprobs_mode`` reports for one row, and of
the row's kept mass, written from the definitions (``layers/logprobs_mode.py``) one
token at a time in float64, with nothing of the sampler's code."""

from __future__ import annotations

import math

import attrs
import torch

from kvrunner.sampling_params import SamplingParams


@attrs.frozen
class Reference:
    """One row's reference: every token's reported value under each mode, the kept
    mass, and how close the nearest threshold decision came (a float32 computation
    may decide a token that close to its threshold the other way)."""

    values: dict[str, torch.Tensor]  # mode -> [V] float64
    kept: list[bool]
    kept_mass: float
    margin: float


def adjusted(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The row after the request's ``logit_bias`` (the only rule these tests set besides
    ``min_p``): float32 values, as the engine's adjusted logits are (a bias too small
    for float32 adds nothing), widened to float64."""
    out = logits.to(torch.float32).clone()
    for token, bias in params.logit_bias:
        out[token] += torch.tensor(bias, dtype=torch.float32)
    return out.to(torch.float64)


def reference(logits: torch.Tensor, params: SamplingParams) -> Reference:
    """What each mode reports for the row ``logits`` ([V], raw) sampled with ``params``."""
    raw = logits.to(torch.float64)
    base = adjusted(logits, params)
    vocab = len(base)
    values = {"raw_logprobs": torch.log_softmax(raw, dim=0), "raw_logits": raw.clone()}
    if params.temperature == 0.0:  # greedy: the adjusted logits, nothing truncated
        values["processed_logits"] = base.clone()
        values["processed_logprobs"] = torch.log_softmax(base, dim=0)
        return Reference(values, [True] * vocab, 1.0, math.inf)
    scaled = base / params.temperature
    full = torch.softmax(scaled, dim=0).tolist()
    margin = math.inf
    kept = [not math.isinf(v) for v in scaled.tolist()]
    if params.min_p:
        threshold = params.min_p * max(full)
        for t in range(vocab):
            if kept[t]:
                margin = min(margin, abs(full[t] - threshold) / max(threshold, 1e-300))
                kept[t] = full[t] >= threshold
    # rank: the larger adjusted logit first, the lower token id among equals
    order = sorted(range(vocab), key=lambda t: (-base[t].item(), t))
    if 0 < params.top_k < vocab:
        for rank, t in enumerate(order):
            if rank >= params.top_k:
                kept[t] = False
    if params.top_p < 1.0:
        total = sum(full[t] for t in range(vocab) if kept[t])
        before = 0.0
        survivors = [t for t in order if kept[t]]
        for t in survivors:
            share = full[t] / total
            margin = min(margin, abs(before - params.top_p))
            kept[t] = before < params.top_p
            before += share
    mass = sum(full[t] for t in range(vocab) if kept[t])
    processed = torch.tensor([scaled[t].item() if kept[t] else -math.inf for t in range(vocab)],
                             dtype=torch.float64)  # fmt: skip
    values["processed_logits"] = processed
    values["processed_logprobs"] = torch.log_softmax(processed, dim=0)
    return Reference(values, kept, mass, margin)
