"""What the sampler reports as a token's logprob (vLLM's ``logprobs_mode``), and the
mass its truncation kept.

The engine-wide mode (``EngineConfig.logprobs_mode``, ``kvrunner serve --logprobs-mode``)
takes vLLM's four names and meanings:

* ``raw_logprobs`` (default): ``log_softmax`` of the model's logits, before anything the
  request's sampling settings change; what a trainer's plain forward computes.
* ``raw_logits``: the model's logits themselves, widened to float32.
* ``processed_logits``: the logits the row's token was picked from: vLLM's logit
  adjustments (penalties, bias, masks: ``layers/logit_processing.py``), then, for a
  drawing row, the temperature, ``min_p``, top-k and top-p (``sampling_draw.truncate_``,
  the draw's own code), every dropped token at ``-inf``.
* ``processed_logprobs``: ``log_softmax`` of the processed logits: the distribution the
  token was drawn from, renormalised over the tokens kept.

A greedy row's processed logits are its adjusted logits (temperature 1, nothing
truncated: its pick ignores top-k, top-p and ``min_p``), as vLLM's all-greedy steps
give. The mode sets the sampled token's value and the top logprobs (ranked by the same
values, so a processed top-N may list dropped tokens at ``-inf``); prompt logprobs stay
raw whatever the mode, as vLLM's do.

**Kept mass** (``SamplingParams.return_kept_mass``): for each sampled token, the
probability the truncation kept: the sum of ``softmax(adjusted / T)`` over the tokens
``min_p``, top-k and top-p leave (1 for a greedy row, and for a row none of them
touches). It is what separates the processed logprob from a full-vocabulary one at the
same temperature: ``processed_logprob = log softmax(adjusted / T)[token] - log(kept_mass)``,
so a trainer scoring the full vocabulary adds ``log(kept_mass)`` to the engine's
processed logprob to compare like with like (the bias vLLM #42259 and TRL #6789
describe). It is computed whatever the mode.
"""

from __future__ import annotations

import numpy as np
import torch

from kvrunner.config import LOGPROBS_MODES
from kvrunner.engine.step_io import SamplingColumns
from kvrunner.layers.sampling_draw import truncate_
from kvrunner.plugin_api.buffers import on_device


def check_logprobs_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`~kvrunner.config.LOGPROBS_MODES`.

    :raises ValueError: naming the modes, for any other value.
    """
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}; "
                         f"got {mode!r}")  # fmt: skip
    return mode


def processed_logits(
    logits: torch.Tensor, sampling: SamplingColumns, *, with_mass: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[N, V]`` float32: each row's processed logits (see the module docstring), from
    ``logits`` (the raw logits, or the rule-adjusted ones of a step with rules), and,
    with ``with_mass``, ``[N]`` float32 each row's kept mass (else None)."""
    out = logits.to(torch.float32, copy=True)
    n = out.shape[0]
    index = np.flatnonzero(sampling.drawing)
    mass = torch.ones(n, dtype=torch.float32, device=out.device) if with_mass else None
    if not len(index):
        return out, mass
    every = len(index) == n
    rows = None if every else on_device(index, torch.int64, out.device)
    base = out if every else out.index_select(0, rows)
    drawing = sampling if every else sampling.take(index)
    scaled = base / on_device(drawing.temperature, torch.float32, out.device)[:, None]
    full = scaled.logsumexp(dim=-1) if with_mass else None  # before truncate_ masks in place
    kept = truncate_(scaled, base, drawing)
    if mass is not None:
        kept_mass = (kept.logsumexp(dim=-1) - full).exp()
        if every:
            mass = kept_mass
        else:
            mass[rows] = kept_mass
    if every:
        return kept, mass
    out[rows] = kept
    return out, mass


def reported_values(
    raw: torch.Tensor,
    sampling: SamplingColumns,
    mode: str,
    *,
    adjusted: torch.Tensor | None = None,
    values: bool = True,
    with_mass: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``[N, V]`` float32: what ``mode`` reports for every token of every row (None
    without ``values``), and ``[N]`` the rows' kept masses (None without ``with_mass``).

    :param raw: the model's logits.
    :param adjusted: the logits after the rows' logit rules, where the step has rules
        (the processed modes start from them; the raw modes never read them).
    """
    check_logprobs_mode(mode)
    processed = mass = None
    if with_mass or (values and mode.startswith("processed")):
        processed, mass = processed_logits(raw if adjusted is None else adjusted, sampling,
                                           with_mass=with_mass)  # fmt: skip
    if not values:
        return None, mass
    if mode == "raw_logprobs":
        # The call prompt logprobs make too (layers/prompt_logprobs.py): the same bits.
        return torch.log_softmax(raw, dim=-1, dtype=torch.float32), mass
    if mode == "raw_logits":
        return raw.to(torch.float32), mass
    if mode == "processed_logits":
        return processed, mass
    return torch.log_softmax(processed, dim=-1), mass
