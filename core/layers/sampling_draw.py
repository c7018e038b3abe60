"""How the sampler draws its non-greedy rows: ``argmax(logits / T + G)`` over the
filtered logits, with ``G`` standard Gumbel noise (see ``sampler.py`` for the rules).

Two paths. The one-pass Triton kernel (``layers/fused/gumbel_argmax_triton.py``)
serves keyed rows (a seed of their own, or the engine's key for an unseeded request:
``sampling_seeds.row_keys``) without top-k / top-p; every other row takes the torch
path: the scaling, the filter (a sort), the noise (keyed rows keyed on the device, or
torch's generator re-seeded per row without Triton; rows given no key draw from a
shared generator), and an argmax.
"""

from __future__ import annotations

import torch

from kvrunner.layers.fused.dispatch import fused_sampler_enabled, use_triton
from kvrunner.layers.sampling_seeds import int64_seed, step_seed
from kvrunner.plugin_api.buffers import on_device
from kvrunner.sampling_params import SamplingParams


def _filter(scaled: torch.Tensor, raw: torch.Tensor, top_ks: list[int],
            top_ps: list[float]) -> torch.Tensor:
    """Set every logit outside each row's top-k set / top-p nucleus to ``-inf``. The
    ranking is ``raw``'s (the logits before the temperature): dividing keeps the order
    but may merge two logits (a subnormal halved to zero), ranking a lower one first."""
    rows, vocab = scaled.shape
    ks = [k if 0 < k < vocab else vocab for k in top_ks]
    if all(k == vocab for k in ks) and all(p >= 1.0 for p in top_ps):
        return scaled
    device = scaled.device
    # Stable sort: among equal logits the lower token id ranks first, as argmax does.
    order = raw.sort(dim=-1, descending=True, stable=True).indices
    values = scaled.gather(-1, order)  # non-increasing, as the scaling keeps order
    rank = torch.arange(vocab, device=device)
    values = values.masked_fill(rank >= on_device(ks, torch.int64, device)[:, None], float("-inf"))
    if any(p < 1.0 for p in top_ps):
        probs = values.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # A disabled row gets a threshold no mass reaches: its cumsum may round past 1.
        ps = on_device([p if p < 1.0 else 2.0 for p in top_ps], torch.float32, device)
        values = values.masked_fill(mass_before >= ps[:, None], float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, values)


def _gumbel(
    rows: int,
    vocab: int,
    seeds: list[int | None],
    counts: list[int],
    generator: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    """``[rows, vocab]`` standard Gumbel noise; a seeded row's noise depends only on
    its ``(seed, count)`` (and the vocabulary size and device)."""
    u = torch.empty(rows, vocab, device=device)
    unseeded = [i for i, s in enumerate(seeds) if s is None]
    if len(unseeded) == rows:
        u.uniform_(generator=generator)  # the same draws as torch.rand, with no index
    elif unseeded:
        u[on_device(unseeded, torch.int64, device)] = torch.rand(
            len(unseeded), vocab, generator=generator, device=device
        )
    seeded = [i for i, s in enumerate(seeds) if s is not None]
    if seeded and use_triton(u):
        from kvrunner.layers.fused.seeded_uniform_triton import seeded_uniform_

        # One launch of a counter-based generator for every seeded row, keyed on the
        # device: no per-row hashing here.
        seeded_uniform_(
            u,
            on_device(seeded, torch.int64, device),
            on_device([int64_seed(seeds[i]) for i in seeded], torch.int64, device),
            on_device([counts[i] for i in seeded], torch.int64, device),
        )
    elif seeded:
        # Without Triton: one generator re-seeded per row.
        g = torch.Generator(device=device)
        for i in seeded:
            g.manual_seed(step_seed(seeds[i], counts[i]))
            u[i].uniform_(generator=g)
    # Keep u strictly inside (0, 1) so both logs are finite: an infinite noise value
    # could lift a filtered (-inf) token to NaN and NaN wins argmax.
    eps = torch.finfo(u.dtype).eps
    u.clamp_(min=torch.finfo(u.dtype).tiny, max=1.0 - eps)
    return u.log_().neg_().log_().neg_()  # -log(-log(u)), in place: no [N, V] temporaries


def draw_rows(
    logits: torch.Tensor,
    rows: torch.Tensor | None,
    params: list[SamplingParams],
    counts: list[int],
    generator: torch.Generator | None,
    keys: list[int] | None = None,
) -> torch.Tensor:
    """The tokens drawn for ``logits``' ``rows`` (every row when ``None``), row ``i``
    with ``params[i]`` after ``counts[i]`` generated tokens: ``argmax(logits / T + G)``
    over the filtered logits, ``G`` Gumbel noise keyed by ``keys[i]`` (default: the
    row's own seed; an unseeded row without a key draws from ``generator``)."""
    device, vocab = logits.device, logits.shape[1]
    temps = on_device([p.temperature for p in params], torch.float32, device)
    if use_fused_draw(logits, params, keyed=keys is not None):
        from kvrunner.layers.fused.gumbel_argmax_triton import gumbel_argmax

        # keys and counts (and every row's id, when no rows were given) in one upload:
        # each upload is a pinned copy and a launch
        if keys is None:
            keys = [int64_seed(p.seed) for p in params]
        cols = [keys, counts]
        if rows is None:
            rows, *cols = on_device([list(range(len(params))), *cols], torch.int64, device)
        else:
            cols = on_device(cols, torch.int64, device)
        return gumbel_argmax(logits, rows, temps, cols[0], cols[1])
    raw = logits if rows is None else logits[rows]
    scaled = raw / temps[:, None]  # dividing by float32 temperatures widens in this pass
    scaled = _filter(scaled, raw, [p.top_k for p in params], [p.top_p for p in params])
    seeds = [p.seed for p in params] if keys is None else keys
    noise = _gumbel(len(params), vocab, seeds, counts, generator, device)
    return scaled.add_(noise).argmax(dim=-1)  # scaled is this call's own tensor


def fused_draw_serves(params: SamplingParams, vocab: int, *, keyed: bool = False) -> bool:
    """Whether the one-pass kernel can draw a row with ``params``: keyed (a seed of its
    own, or ``keyed``: the engine keys it; the kernel makes keyed noise only) and not
    filtered by top-k / top-p (a sort)."""
    return (
        (keyed or params.seed is not None)
        and not 0 < params.top_k < vocab
        and params.top_p >= 1.0
    )


def use_fused_draw(
    logits: torch.Tensor, params: list[SamplingParams], *, keyed: bool = False
) -> bool:
    """Whether the one-pass kernel draws these rows: not switched off
    (``[kernels] fused_sampler = false``), on the Triton path, and it serves every row
    (``keyed``: every row has a key)."""
    vocab = logits.shape[1]
    serves = (fused_draw_serves(p, vocab, keyed=keyed) for p in params)
    return fused_sampler_enabled() and use_triton(logits) and all(serves)
