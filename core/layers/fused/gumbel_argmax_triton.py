"""Triton kernel: the seeded rows' draws in one pass over their logits.

The sampler's torch path draws a seeded row's token as ``argmax(logits / T + G)``
with ``G = -log(-log(u))`` and ``u`` from :func:`seeded_uniform_`: about ten passes
over ``[N, vocab]`` float32 (the division, the noise, its clamp and four logs and
negations, the sum, the argmax), some 2.6 GB a step at 256 rows of a 152k
vocabulary. This kernel makes the same draw reading each logit once: one program a
row walks the vocabulary in tiles, makes ``u`` with the same counter-based generator
and key as :func:`seeded_uniform_` (``tl.rand(seed * KEY_STRIDE + count, column)``,
so the noise is the same bits), and keeps the running first maximum.

The draw equals the torch path's wherever the largest perturbed score leads the
next by more than a float32 rounding of it: the two compute the same expression
with their own ``log``. A row holding a NaN (which the sampler reports through its
row maxima) draws some column in range, not necessarily torch's. Rows with top-k /
top-p filters, or without a seed, keep the torch path (a sort, and torch's
generator). The default on the Triton path (``KVRUNNER_FUSED_SAMPLER=0`` keeps the
torch path): 0.31-0.62x the torch path's time on an H200 at batch 1-1,024, every
token the same (``benchmarks/bench_sampler.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrunner.layers.fused.seeded_uniform_triton import KEY_STRIDE

#: vocabulary columns per tile
BLOCK = 2048


@triton.jit
def _first_max_of_perturbed(
    logits_ptr, row, stride_l, temp, key, vocab,
    TINY: tl.constexpr, TOP: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """The first column of ``row`` holding the largest ``logit / temp + G``."""
    best = tl.full((), float("-inf"), tl.float32)
    best_col = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < vocab
        x = tl.load(logits_ptr + row * stride_l + cols, mask=mask, other=float("-inf"))
        u = tl.minimum(tl.maximum(tl.rand(key, cols), TINY), TOP)
        # div_rn: the correctly rounded quotient torch computes (``/`` may be approximate)
        score = tl.math.div_rn(x.to(tl.float32), temp) - tl.log(-tl.log(u))
        score = tl.where(mask, score, float("-inf"))
        tile_best = tl.max(score, 0)
        # the first column holding the tile's maximum, as torch's argmax picks
        tile_col = tl.min(tl.where(score == tile_best, cols, vocab), 0).to(tl.int64)
        take = tile_best > best  # strict: an equal later tile keeps the earlier column
        best_col = tl.where(take, tile_col, best_col)
        best = tl.where(take, tile_best, best)
    return best_col


@triton.jit
def _gumbel_argmax_kernel(
    logits_ptr, stride_l, rows_ptr, temps_ptr, seeds_ptr, counts_ptr, out_ptr,
    vocab,
    KEY_STRIDE: tl.constexpr, TINY: tl.constexpr, TOP: tl.constexpr, BLOCK_V: tl.constexpr,
    KEEP_GREEDY: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    temp = tl.load(temps_ptr + i)
    key = tl.load(seeds_ptr + i) * KEY_STRIDE + tl.load(counts_ptr + i)
    if KEEP_GREEDY:
        # Row i of the logits; a row at temperature 0 keeps the token already in
        # out (its argmax) and reads nothing.
        if temp > 0.0:
            row = i.to(tl.int64)
            col = _first_max_of_perturbed(logits_ptr, row, stride_l, temp, key, vocab,
                                          TINY, TOP, BLOCK_V)
            tl.store(out_ptr + i, col)
    else:
        row = tl.load(rows_ptr + i).to(tl.int64)
        col = _first_max_of_perturbed(logits_ptr, row, stride_l, temp, key, vocab,
                                      TINY, TOP, BLOCK_V)
        tl.store(out_ptr + i, col)


def gumbel_argmax(
    logits: torch.Tensor,
    rows: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    counts: torch.Tensor,
) -> torch.Tensor:
    """The token drawn for each ``rows[i]`` of ``logits`` at ``temperatures[i]``, with
    the noise :func:`seeded_uniform_` keys by ``(seeds[i], counts[i])``; ``[S]`` int64.

    :param logits: ``[N, V]`` float32 / bfloat16 / float16, last dimension contiguous.
    :param rows: ``[S]`` int64 row indices; ``temperatures`` ``[S]`` float32 (> 0);
        ``seeds`` / ``counts`` ``[S]`` int64.
    No host sync: the launch is capturable in a CUDA graph.
    """
    assert temperatures.dtype == torch.float32
    assert rows.shape == temperatures.shape == seeds.shape == counts.shape
    assert rows.dtype == seeds.dtype == counts.dtype == torch.int64
    out = torch.empty(rows.shape, dtype=torch.int64, device=logits.device)
    vocab = logits.shape[1]
    if rows.numel() == 0 or vocab == 0:
        return out.zero_()
    _launch(out, logits, rows, temperatures, seeds, counts, keep_greedy=False)
    return out


def gumbel_argmax_into_(
    tokens: torch.Tensor,
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    counts: torch.Tensor,
) -> torch.Tensor:
    """Overwrite ``tokens[i]`` with the draw for row ``i`` of ``logits`` wherever
    ``temperatures[i] > 0`` (the noise as :func:`gumbel_argmax`'s); a row at
    temperature 0 keeps its token and costs no pass over its logits.

    For a batch of greedy and seeded rows in one launch, after ``tokens`` took the
    rows' argmax: what the decode graph captures (``runner/graph_sampling.py``).
    """
    n = tokens.shape[0]
    assert tokens.dtype == seeds.dtype == counts.dtype == torch.int64
    assert temperatures.dtype == torch.float32 and logits.shape[0] >= n
    assert temperatures.shape == seeds.shape == counts.shape == tokens.shape
    if n and logits.shape[1]:
        _launch(tokens, logits, tokens, temperatures, seeds, counts, keep_greedy=True)
    return tokens


def _launch(out, logits, rows, temperatures, seeds, counts, *, keep_greedy: bool) -> None:
    assert logits.stride(-1) == 1
    eps = torch.finfo(torch.float32).eps
    vocab = logits.shape[1]
    _gumbel_argmax_kernel[(out.numel(),)](
        logits, logits.stride(0), rows, temperatures, seeds, counts, out, vocab,
        KEY_STRIDE=KEY_STRIDE, TINY=torch.finfo(torch.float32).tiny, TOP=1.0 - eps,
        BLOCK_V=min(BLOCK, triton.next_power_of_2(vocab)), KEEP_GREEDY=keep_greedy,
        num_warps=8,
    )  # fmt: skip
