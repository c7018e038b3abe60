"""Triton kernel: the seeded rows' draws in one pass over their logits.

The sampler's torch path draws a seeded row's token as ``argmax(logits / T + G)``
with ``G = -log(-log(u))`` and ``u`` from :func:`seeded_uniform_`: about ten passes
over ``[N, vocab]`` float32 (the division, the noise, its clamp and four logs and
negations, the sum, the argmax), some 2.6 GB a step at 256 rows of a 152k
vocabulary. This kernel makes the same draw reading each logit once: a program walks
a slice of a row's vocabulary in tiles, makes ``u`` with the same counter-based
generator and key as :func:`seeded_uniform_` (``tl.rand(seed * KEY_STRIDE + count,
column)``, so the noise is the same bits), and keeps the running first maximum. With
few rows a row is cut into several slices (:func:`vocab_splits`) and a second launch
takes the first maximum of their partials: the token is the one-slice token bit for
bit. One program a row walking all 152k columns left most of an H200 idle: a seeded
decode step took 165 us more than a greedy one at batch 1 and 64
(``benchmarks/bench_graph_end.py``); cut, the kernel takes 5.7 us at one row and
73 us at 64 where it took 154 (``benchmarks/bench_sampler.py``).

The draw equals the torch path's wherever the largest perturbed score leads the
next by more than a float32 rounding of it: the two compute the same expression
with their own ``log``. A row holding a NaN (which the sampler reports through its
row maxima) draws some column in range, not necessarily torch's. Rows with top-k /
top-p filters keep the torch path (a sort); an unseeded row is drawn here with the
engine's key for its request (``layers/sampling_seeds.py``). The default on the
Triton path (``[kernels] fused_sampler = false`` keeps the torch path): 0.31-0.62x the
torch path's time on an H200 at batch 1-1,024, every token the same
(``benchmarks/bench_sampler.py``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvrunner.layers.fused.seeded_uniform_triton import KEY_STRIDE

#: vocabulary columns per tile
BLOCK = 2048
#: programs per streaming multiprocessor the vocabulary split aims for
PROGRAMS_PER_SM = 2


@triton.jit
def _first_max_of_perturbed(
    logits_ptr, row, stride_l, temp, key, lo, hi,
    TINY: tl.constexpr, TOP: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """The largest ``logit / temp + G`` of ``row`` over columns ``[lo, hi)``, and the
    first column holding it (``-inf`` and column 0 when every score is ``-inf``)."""
    best = tl.full((), float("-inf"), tl.float32)
    best_col = tl.full((), 0, tl.int64)
    for start in range(lo, hi, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < hi
        x = tl.load(logits_ptr + row * stride_l + cols, mask=mask, other=float("-inf"))
        u = tl.minimum(tl.maximum(tl.rand(key, cols), TINY), TOP)
        # div_rn: the correctly rounded quotient torch computes (``/`` may be approximate)
        score = tl.math.div_rn(x.to(tl.float32), temp) - tl.log(-tl.log(u))
        score = tl.where(mask, score, float("-inf"))
        tile_best = tl.max(score, 0)
        # the first column holding the tile's maximum, as torch's argmax picks
        tile_col = tl.min(tl.where(score == tile_best, cols, hi), 0).to(tl.int64)
        take = tile_best > best  # strict: an equal later tile keeps the earlier column
        best_col = tl.where(take, tile_col, best_col)
        best = tl.where(take, tile_best, best)
    return best, best_col


# The slice count is a runtime argument, not specialised on: each decode-graph bucket
# has its own (75 at one row, 5 at 64, ...), and as a compile-time constant every
# bucket compiled both kernels anew on a cold cache (a capture of 20 buckets took 10 s).
@triton.jit(do_not_specialize=["splits"])
def _gumbel_argmax_kernel(
    logits_ptr, stride_l, rows_ptr, temps_ptr, seeds_ptr, counts_ptr, out_ptr,
    part_best_ptr, part_col_ptr, vocab, cols_per_split, splits,
    KEY_STRIDE: tl.constexpr, TINY: tl.constexpr, TOP: tl.constexpr, BLOCK_V: tl.constexpr,
    KEEP_GREEDY: tl.constexpr, ONE_SLICE: tl.constexpr,
):  # fmt: skip
    """Program ``(i, s)``: row ``i``'s draw over the ``s``-th slice of the vocabulary,
    into ``out`` (one slice) or the partials (several, reduced by the next kernel)."""
    i = tl.program_id(0)
    lo = tl.program_id(1) * cols_per_split
    hi = tl.minimum(lo + cols_per_split, vocab)
    temp = tl.load(temps_ptr + i)
    key = tl.load(seeds_ptr + i) * KEY_STRIDE + tl.load(counts_ptr + i)
    if KEEP_GREEDY:
        # Row i of the logits; a row at temperature 0 keeps the token already in
        # out (its argmax) and reads nothing.
        row = i.to(tl.int64)
        draws = temp > 0.0
    else:
        row = tl.load(rows_ptr + i).to(tl.int64)
        draws = tl.full((), 1, tl.int1)
    if draws:
        best, col = _first_max_of_perturbed(logits_ptr, row, stride_l, temp, key, lo, hi,
                                            TINY, TOP, BLOCK_V)
        if ONE_SLICE:
            tl.store(out_ptr + i, col)
        else:
            tl.store(part_best_ptr + i * splits + tl.program_id(1), best)
            tl.store(part_col_ptr + i * splits + tl.program_id(1), col)


@triton.jit(do_not_specialize=["splits"])
def _first_max_of_splits_kernel(
    part_best_ptr, part_col_ptr, temps_ptr, out_ptr, splits,
    KEEP_GREEDY: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Row ``i``'s token from its slices' partials: the largest score's column, the
    earliest slice on a tie (the whole vocabulary's first maximum, as one slice)."""
    i = tl.program_id(0)
    if KEEP_GREEDY:
        draws = tl.load(temps_ptr + i) > 0.0
    else:
        draws = tl.full((), 1, tl.int1)
    if draws:
        s = tl.arange(0, BLOCK_S)
        best = tl.load(part_best_ptr + i * splits + s, mask=s < splits, other=float("-inf"))
        col = tl.load(part_col_ptr + i * splits + s, mask=s < splits, other=0)
        top = tl.max(best, 0)
        first = tl.min(tl.where(best == top, s, splits), 0)
        # a row whose every score is -inf draws column 0, as one slice does
        tl.store(out_ptr + i, tl.where(top > float("-inf"),
                                       tl.sum(tl.where(s == first, col, 0), 0), 0))


def vocab_splits(rows: int, vocab: int, device: torch.device) -> int:
    """Slices of the vocabulary a row's draw is cut into: enough programs to give each
    streaming multiprocessor :data:`PROGRAMS_PER_SM` (below 132 rows, one program a row
    leaves most of an H200 idle), never a slice under one tile, and one slice (no
    reduce launch) where the rows already fill the chip. One off CUDA (the
    interpreter, where tests choose the slices)."""
    if device.type != "cuda":
        return 1
    programs = PROGRAMS_PER_SM * _multiprocessors(device.index)
    return max(1, min(triton.cdiv(programs, max(rows, 1)), triton.cdiv(vocab, BLOCK)))


@functools.cache
def _multiprocessors(index: int | None) -> int:
    """The device's multiprocessor count, asked once (the draw runs every step)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def gumbel_argmax(
    logits: torch.Tensor,
    rows: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    counts: torch.Tensor,
    *,
    splits: int | None = None,
) -> torch.Tensor:
    """The token drawn for each ``rows[i]`` of ``logits`` at ``temperatures[i]``, with
    the noise :func:`seeded_uniform_` keys by ``(seeds[i], counts[i])``; ``[S]`` int64.

    :param logits: ``[N, V]`` float32 / bfloat16 / float16, last dimension contiguous.
    :param rows: ``[S]`` int64 row indices; ``temperatures`` ``[S]`` float32 (> 0);
        ``seeds`` / ``counts`` ``[S]`` int64.
    :param splits: vocabulary slices a row is cut into (``None``: :func:`vocab_splits`);
        the tokens are the same for every value.
    No host sync: the launch is capturable in a CUDA graph.
    """
    assert temperatures.dtype == torch.float32
    assert rows.shape == temperatures.shape == seeds.shape == counts.shape
    assert rows.dtype == seeds.dtype == counts.dtype == torch.int64
    out = torch.empty(rows.shape, dtype=torch.int64, device=logits.device)
    vocab = logits.shape[1]
    if rows.numel() == 0 or vocab == 0:
        return out.zero_()
    _launch(out, logits, rows, temperatures, seeds, counts, keep_greedy=False, splits=splits)
    return out


def gumbel_argmax_into_(
    tokens: torch.Tensor,
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    counts: torch.Tensor,
    *,
    splits: int | None = None,
) -> torch.Tensor:
    """Overwrite ``tokens[i]`` with the draw for row ``i`` of ``logits`` wherever
    ``temperatures[i] > 0`` (the noise as :func:`gumbel_argmax`'s); a row at
    temperature 0 keeps its token and costs no pass over its logits.

    For a batch of greedy and seeded rows in one launch, after ``tokens`` took the
    rows' argmax: what the decode graph captures (``runner/capture/graph_sampling.py``).
    """
    n = tokens.shape[0]
    assert tokens.dtype == seeds.dtype == counts.dtype == torch.int64
    assert temperatures.dtype == torch.float32 and logits.shape[0] >= n
    assert temperatures.shape == seeds.shape == counts.shape == tokens.shape
    if n and logits.shape[1]:
        _launch(tokens, logits, tokens, temperatures, seeds, counts, keep_greedy=True,
                splits=splits)
    return tokens


def _launch(out, logits, rows, temperatures, seeds, counts, *, keep_greedy: bool,
            splits: int | None) -> None:
    assert logits.stride(-1) == 1
    eps = torch.finfo(torch.float32).eps
    n, vocab = out.numel(), logits.shape[1]
    block_v = min(BLOCK, triton.next_power_of_2(vocab))
    splits = vocab_splits(n, vocab, logits.device) if splits is None else splits
    # whole tiles a slice, and no empty slice after rounding up
    cols_per_split = triton.cdiv(triton.cdiv(vocab, splits), block_v) * block_v
    splits = triton.cdiv(vocab, cols_per_split)
    part_best = part_col = out  # unused with one slice
    if splits > 1:
        part_best = torch.empty(n, splits, dtype=torch.float32, device=out.device)
        part_col = torch.empty(n, splits, dtype=torch.int64, device=out.device)
    _gumbel_argmax_kernel[(n, splits)](
        logits, logits.stride(0), rows, temperatures, seeds, counts, out,
        part_best, part_col, vocab, cols_per_split, splits,
        KEY_STRIDE=KEY_STRIDE, TINY=torch.finfo(torch.float32).tiny, TOP=1.0 - eps,
        BLOCK_V=block_v, KEEP_GREEDY=keep_greedy, ONE_SLICE=splits == 1, num_warps=8,
    )  # fmt: skip
    if splits > 1:
        # One block wide enough for the most slices this vocabulary can have (one tile
        # each): the same compile for every slice count.
        _first_max_of_splits_kernel[(n,)](
            part_best, part_col, temperatures, out, splits, KEEP_GREEDY=keep_greedy,
            BLOCK_S=triton.next_power_of_2(triton.cdiv(vocab, block_v)),
        )  # fmt: skip
