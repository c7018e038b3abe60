"""How the sampler draws its non-greedy rows: ``argmax(logits / T + G)`` over the
filtered logits, with ``G`` standard Gumbel noise (see ``sampler.py`` for the rules).

Two paths. The one-pass Triton kernel (``layers/fused/gumbel_argmax_triton.py``)
serves keyed rows (a seed of their own, or the engine's key for an unseeded request:
``sampling_seeds.row_keys``) without top-k / top-p; every other row takes the torch
path: the scaling, the filter (a sort), the noise (keyed rows keyed on the device, or
torch's generator re-seeded per row without Triton; rows given no key draw from a
shared generator), and an argmax.

Every per-row setting is read from the rows' :class:`SamplingColumns` and goes up
to the device straight from its array.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from kvrunner.engine.step_io import SamplingColumns
from kvrunner.layers.fused.dispatch import fused_sampler_enabled, use_triton
from kvrunner.layers.logit_processing import mask_min_p_, min_p_of
from kvrunner.layers.sampling_seeds import step_seed
from kvrunner.plugin_api.buffers import on_device


def _filter(scaled: torch.Tensor, raw: torch.Tensor, top_k: np.ndarray,
            top_p: np.ndarray) -> torch.Tensor:
    """Set every logit outside each row's top-k set / top-p nucleus to ``-inf``. The
    ranking is ``raw``'s (the logits before the temperature): dividing keeps the order
    but may merge two logits (a subnormal halved to zero), ranking a lower one first."""
    rows, vocab = scaled.shape
    ks = np.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    nucleus = top_p < 1.0
    if not nucleus.any() and (ks == vocab).all():
        return scaled
    device = scaled.device
    # Stable sort: among equal logits the lower token id ranks first, as argmax does.
    order = raw.sort(dim=-1, descending=True, stable=True).indices
    values = scaled.gather(-1, order)  # non-increasing, as the scaling keeps order
    rank = torch.arange(vocab, device=device)
    values = values.masked_fill(rank >= on_device(ks, torch.int64, device)[:, None], float("-inf"))
    if nucleus.any():
        probs = values.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # A disabled row gets a threshold no mass reaches: its cumsum may round past 1.
        ps = on_device(np.where(nucleus, top_p, 2.0), torch.float32, device)
        values = values.masked_fill(mass_before >= ps[:, None], float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, values)


def truncate_(scaled: torch.Tensor, raw: torch.Tensor, sampling: SamplingColumns
              ) -> torch.Tensor:  # fmt: skip
    """The drawing rows' logits after the temperature (``scaled``, float32, changed in
    place) with every token the row's ``min_p``, top-k and top-p drop at ``-inf``, in
    vLLM's order (``min_p`` first, top-p renormalised after top-k); ``raw`` (the logits
    before the temperature) ranks them. Returns ``scaled`` or a new tensor."""
    min_p = min_p_of(sampling)
    if min_p is not None:
        mask_min_p_(scaled, min_p)
    return _filter(scaled, raw, sampling.top_k, sampling.top_p)


def _gumbel(
    rows: int,
    vocab: int,
    keys: np.ndarray,
    keyed: np.ndarray,
    counts: np.ndarray,
    generator: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    """``[rows, vocab]`` standard Gumbel noise; a keyed row's noise depends only on its
    ``(keys[i], counts[i])`` (and the vocabulary size and device); the others draw
    from ``generator``."""
    u = torch.empty(rows, vocab, device=device)
    unkeyed = np.flatnonzero(~keyed)
    if len(unkeyed) == rows:
        u.uniform_(generator=generator)  # the same draws as torch.rand, with no index
    elif len(unkeyed):
        u[on_device(unkeyed, torch.int64, device)] = torch.rand(
            len(unkeyed), vocab, generator=generator, device=device
        )
    seeded = np.flatnonzero(keyed)
    if len(seeded) and use_triton(u):
        from kvrunner.layers.fused.seeded_uniform_triton import seeded_uniform_

        # One launch of a counter-based generator for every keyed row, keyed on the
        # device: no per-row hashing here.
        index, row_keys, row_counts = on_device(
            np.stack([seeded, keys[seeded], counts[seeded]]), torch.int64, device
        )
        seeded_uniform_(u, index, row_keys, row_counts)
    elif len(seeded):
        # Without Triton: one generator re-seeded per row.
        g = torch.Generator(device=device)
        for i, key, count in zip(seeded.tolist(), keys[seeded].tolist(),
                                 counts[seeded].tolist(), strict=True):  # fmt: skip
            g.manual_seed(step_seed(key, count))
            u[i].uniform_(generator=g)
    # Keep u strictly inside (0, 1) so both logs are finite: an infinite noise value
    # could lift a filtered (-inf) token to NaN and NaN wins argmax.
    eps = torch.finfo(u.dtype).eps
    u.clamp_(min=torch.finfo(u.dtype).tiny, max=1.0 - eps)
    return u.log_().neg_().log_().neg_()  # -log(-log(u)), in place: no [N, V] temporaries


class Drawn(NamedTuple):
    """What :func:`draw_rows` drew."""

    tokens: torch.Tensor  # [N] int64
    #: [N, V] float32: the rows' logits after the temperature and the truncation, as
    #: drawn from (``truncate_``), when asked for and the torch path drew; else None
    truncated: torch.Tensor | None


def draw_rows(
    logits: torch.Tensor,
    rows: torch.Tensor | None,
    sampling: SamplingColumns,
    counts: Sequence[int] | np.ndarray,
    generator: torch.Generator | None,
    keys: np.ndarray | None = None,
    *,
    keep_truncated: bool = False,
) -> Drawn:
    """The tokens drawn for ``logits``' ``rows`` (every row when ``None``), row ``i``
    with ``sampling``'s row ``i`` after ``counts[i]`` generated tokens:
    ``argmax(logits / T + G)`` over the filtered logits, ``G`` Gumbel noise keyed by
    ``keys[i]`` (default: the row's own seed; an unseeded row without a key draws from
    ``generator``). ``keep_truncated``: also the filtered logits (the processed
    logprobs read them: ``layers/logprobs_mode.py``), at one more ``[N, V]`` tensor."""
    device, vocab = logits.device, logits.shape[1]
    counts = np.asarray(counts, np.int64)
    temps = on_device(sampling.temperature, torch.float32, device)
    keyed = keys is not None
    if keys is None:
        keys = sampling.seed
    if use_fused_draw(logits, sampling, keyed=keyed):
        from kvrunner.layers.fused.gumbel_argmax_triton import gumbel_argmax

        # keys and counts (and every row's id, when no rows were given) in one upload:
        # each upload is a pinned copy and a launch
        if rows is None:
            rows, row_keys, row_counts = on_device(
                np.stack([np.arange(len(sampling)), keys, counts]), torch.int64, device
            )
        else:
            row_keys, row_counts = on_device(np.stack([keys, counts]), torch.int64, device)
        return Drawn(gumbel_argmax(logits, rows, temps, row_keys, row_counts), None)
    raw = logits if rows is None else logits[rows]
    scaled = raw / temps[:, None]  # dividing by float32 temperatures widens in this pass
    scaled = truncate_(scaled, raw, sampling)
    noise = _gumbel(len(sampling), vocab, keys,
                    np.ones(len(sampling), bool) if keyed else sampling.has_seed, counts,
                    generator, device)  # fmt: skip
    if keep_truncated:
        return Drawn(noise.add_(scaled).argmax(dim=-1), scaled)
    return Drawn(scaled.add_(noise).argmax(dim=-1), None)  # scaled is this call's own tensor


def fused_draw_serves(sampling: SamplingColumns, vocab: int, *, keyed: bool = False
                      ) -> np.ndarray:  # fmt: skip
    """[N] bool: whether the one-pass kernel can draw each row: keyed (a seed of its
    own, or ``keyed``: the engine keys every row; the kernel makes keyed noise only)
    and not filtered by top-k / top-p (a sort) or ``min_p`` (a softmax)."""
    top_k = sampling.top_k
    serves = ~((top_k > 0) & (top_k < vocab)) & (sampling.top_p >= 1.0)
    min_p = min_p_of(sampling)
    if min_p is not None:
        serves &= min_p == 0
    return serves if keyed else serves & sampling.has_seed


def use_fused_draw(
    logits: torch.Tensor, sampling: SamplingColumns, *, keyed: bool = False
) -> bool:
    """Whether the one-pass kernel draws these rows: not switched off
    (``[kernels] fused_sampler = false``), on the Triton path, and it serves every row
    (``keyed``: every row has a key)."""
    return (
        fused_sampler_enabled()
        and use_triton(logits)
        and bool(fused_draw_serves(sampling, logits.shape[1], keyed=keyed).all())
    )
