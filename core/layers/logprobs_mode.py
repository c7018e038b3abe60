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
from kvrunner.layers.sampling_draw import fused_draw_serves, truncate_
from kvrunner.plugin_api.buffers import on_device


def check_logprobs_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`~kvrunner.config.LOGPROBS_MODES`.

    :raises ValueError: naming the modes, for any other value.
    """
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}; "
                         f"got {mode!r}")  # fmt: skip
    return mode


def reads_processed(sampling: SamplingColumns, mode: str) -> bool:
    """Whether a step's logprobs read the processed logits: a row asks for logprobs in
    a processed mode, or for its kept mass."""
    wants_logprobs = mode.startswith("processed") and int(sampling.logprobs.max(initial=-1)) >= 0
    return wants_logprobs or bool(sampling.kept_mass.any())


def processed_logits(
    logits: torch.Tensor,
    sampling: SamplingColumns,
    *,
    with_mass: bool = False,
    truncated: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[N, V]`` float32: each row's processed logits (see the module docstring), from
    ``logits`` (the raw logits, or the rule-adjusted ones of a step with rules), and,
    with ``with_mass``, ``[N]`` float32 each row's kept mass (else None).

    :param truncated: the drawing rows' logits after the temperature and the truncation,
        in row order, where the draw kept them (``sampling_draw.Drawn``): taken as they
        are instead of truncating again.
    """
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
    # a row no min_p / top-k / top-p touches keeps all its mass
    truncating = not fused_draw_serves(drawing, out.shape[1], keyed=True).all()
    scaled = full = None
    if truncated is None or (with_mass and truncating):
        scaled = base / on_device(drawing.temperature, torch.float32, out.device)[:, None]
    if with_mass and truncating:
        full = scaled.logsumexp(dim=-1)  # before truncate_ masks in place
    kept = truncated if truncated is not None else truncate_(scaled, base, drawing)
    if full is not None:
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
    truncated: torch.Tensor | None = None,
    values: bool = True,
    with_mass: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``[N, V]`` float32: what ``mode`` reports for every token of every row (None
    without ``values``), and ``[N]`` the rows' kept masses (None without ``with_mass``).

    :param raw: the model's logits.
    :param adjusted: the logits after the rows' logit rules, where the step has rules
        (the processed modes start from them; the raw modes never read them).
    :param truncated: the drawing rows' truncated logits, where the draw kept them
        (:func:`processed_logits`).
    """
    check_logprobs_mode(mode)
    processed = mass = None
    if with_mass or (values and mode.startswith("processed")):
        processed, mass = processed_logits(raw if adjusted is None else adjusted, sampling,
                                           with_mass=with_mass, truncated=truncated)  # fmt: skip
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
