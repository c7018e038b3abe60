"""Triton kernel: ``x @ W.T`` computed the same way for every row count.

cuBLAS (and the skinny-GEMM kernel) pick tiles, split-K and even the instruction by
the row count M, so a row's product changes with the batch it shares. Here an output
element's value is fixed by its **reduction**, which depends on the weight's shape
``(N, K)`` only (:func:`invariant_reduction`): K is cut into ``splits`` slices of
whole ``BLOCK_K`` steps; each slice is one chain of ``tl.dot`` steps from its start
into a float32 accumulator, and the slices' sums are added in slice order.

How that work is spread over programs may follow the row count, since it does not
change any element's chain of operations (:func:`invariant_launch`):

* a program per (row tile, column tile, slice), each slice's partial sums in a
  float32 workspace, added in slice order: decode-sized products, where the slices
  keep the machine reading the weight. The tile's last program to finish adds them
  (it counts the tile's finished slices on a counter, see :class:`TileCounters`), so
  the product is one launch; where no counters serve (the first call made inside a
  graph capture, a grid larger than the counters), a second kernel adds them, to the
  same bits;
* or one program per (row tile, column tile) walking every slice and adding each
  slice's sum in registers, in the same order from the same zero: long prefills,
  with no workspace (``splits x M x N`` float32) and no second launch.

The row tile (``block_m``), column tile and warps are the layout's too; on the GPU
they are fixed to one tensor-core instruction per warp group, so a row's bits are the
same in every layout (``tests/core/determinism/test_deterministic_gpu.py`` and
``benchmarks/bench_invariant_kernels.py`` check it on the H200).
"""

from __future__ import annotations

import threading

import attrs
import torch
import triton
import triton.language as tl

from kvrunner.layers.fused.silu_mul_triton import silu_mul_tile
from kvrunner.layers.fused.skinny_gemm_triton import sum_splits

#: the reduction's step: K walked ``BLOCK_K`` at a time from each slice's start
BLOCK_K = 64
#: output tiles x slices wanted in flight for a decode-sized product (two per SM of
#: an H200), counting tiles of ``SLICING_TILE_N`` columns (a constant, not the
#: layout's tile: the slices must not follow the layout), and the most slices
TARGET_PROGRAMS = 264
SLICING_TILE_N = 64
MAX_SPLITS = 4
#: the shallowest slice worth its partial write
MIN_SPLIT_DEPTH = 512
#: from this many rows a product walks its slices inside one program
IN_PROGRAM_ROWS = 512
#: a product of fewer rows walks its slices inside one program too where its output
#: tiles (``block_m`` x ``block_n``) alone number this many: the machine is busy
#: without slicing, and the slices' float32 partials need not be written and read
#: back. None: the row count alone decides (``benchmarks/bench_deterministic.py
#: --sweep-splits gemm`` times both)
WALK_TILES: int | None = None
#: tile counters per device; a launch takes as many as its grid has tiles
COUNTERS = 1 << 20
#: a SwiGLU down projection of at most this many rows forms its input ``silu(gate) *
#: up`` as it loads it (:func:`invariant_gemm`'s ``silu_mul``), one launch a layer
#: fewer; more rows take the activation's kernel first, since every column tile
#: would recompute the activation of the rows it reads
SILU_MUL_MAX_ROWS = 512


@attrs.frozen
class InvariantLaunch:
    """One product's launch. ``block_k`` and ``splits`` are its reduction (an output
    element's bits); the other fields only spread the work."""

    block_k: int  #: the depth of one ``tl.dot`` step
    splits: int  #: K slices, summed in slice order in float32
    block_m: int  #: rows of a program's tile
    block_n: int  #: output columns of a program's tile
    num_warps: int
    num_stages: int  #: software-pipeline depth of the K walk
    in_program: bool  #: one program walks every slice (else a program per slice)
    #: with a program per slice, the tile's last program adds the slices (else a
    #: second kernel does); the same bits either way
    last_program_sums: bool = True


class TileCounters:
    """Per device, a ring of int32 counters, zero between launches, that a
    slice-per-program launch counts its tiles' finished slices on: the program that
    finds its tile's count at ``splits - 1`` adds the slices and sets it back to zero.

    Each launch takes the next ``tiles`` counters of the ring (its offset is fixed when
    a graph captures it). Two launches share a counter only if ``COUNTERS`` counters
    were handed out between them, and launches that can run at once (two streams of
    two-batch overlap, which join every layer) are a few products apart, so no two
    running launches share one. The ring is made eagerly, on first use outside a
    graph capture: the warmup before capture makes it."""

    def __init__(self) -> None:
        self._rings: dict[torch.device, torch.Tensor] = {}
        self._cursor: dict[torch.device, int] = {}
        self._lock = threading.Lock()

    def take(self, device: torch.device, tiles: int) -> torch.Tensor | None:
        """``tiles`` zeroed counters on ``device``, or None (no ring yet during a
        capture, or more tiles than the ring holds)."""
        if tiles > COUNTERS:
            return None
        with self._lock:
            ring = self._rings.get(device)
            if ring is None:
                if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    return None
                ring = self._rings[device] = torch.zeros(COUNTERS, dtype=torch.int32,
                                                         device=device)
                self._cursor[device] = 0
            start = self._cursor[device]
            if start + tiles > COUNTERS:
                start = 0
            self._cursor[device] = start + tiles
            return ring[start:start + tiles]


_COUNTERS = TileCounters()


def slice_depth(k: int, splits: int, block_k: int) -> int:
    """The depth of each of ``splits`` K slices of ``k``: whole ``block_k`` steps, the
    last slice taking what is left. Rounding up may leave fewer non-empty slices than
    ``splits``: ``cdiv(k, slice_depth(...))`` of them."""
    return triton.cdiv(triton.cdiv(k, splits), block_k) * block_k


def invariant_reduction(n: int, k: int) -> tuple[int, int]:
    """``(block_k, splits)`` for a ``[k] -> [n]`` product: from the weight's shape
    alone, never the row count, so every batch reduces each output over the same K
    slices in the same steps."""
    tiles = triton.cdiv(n, SLICING_TILE_N)
    splits = max(1, min(triton.cdiv(TARGET_PROGRAMS, tiles), k // MIN_SPLIT_DEPTH, MAX_SPLITS))
    return BLOCK_K, triton.cdiv(k, slice_depth(k, splits, BLOCK_K))  # no empty slice


def invariant_launch(m: int, n: int, k: int) -> InvariantLaunch:
    """The launch :func:`invariant_gemm` takes for ``m`` rows: the reduction of
    :func:`invariant_reduction` and a layout by row count (the module doc says why
    the layout may follow it)."""
    block_k, splits = invariant_reduction(n, k)
    block_m = block_n = 64
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    in_program = (m >= IN_PROGRAM_ROWS or splits == 1
                  or (WALK_TILES is not None and tiles >= WALK_TILES))
    return InvariantLaunch(block_k, splits, block_m=block_m, block_n=block_n, num_warps=4,
                           num_stages=3, in_program=in_program)


@triton.jit
def _slice_sum(x_ptr, w_ptr, rows, cols, M, N, K, k_start, k_end, stride_xm, stride_wn,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               NUM_STAGES: tl.constexpr, PRECISION: tl.constexpr,
               SILU_MUL: tl.constexpr):  # fmt: skip
    """One K slice's partial sums: ``tl.dot`` steps of ``BLOCK_K`` from ``k_start``.
    ``SILU_MUL``: each row of ``x`` is ``[gate | up]`` of ``2K``, and the product's
    input ``silu(gate) * up`` is formed as it loads, rounded as the activation's
    kernel rounds it (the same bits as that kernel, then this one)."""
    depth = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        ks = k + depth
        in_k = ks < k_end
        x_mask = (rows < M)[:, None] & in_k[None, :]
        x_at = x_ptr + rows[:, None] * stride_xm + ks[None, :]
        x = tl.load(x_at, mask=x_mask, other=0.0)
        if SILU_MUL:
            x = silu_mul_tile(x, tl.load(x_at + K, mask=x_mask, other=0.0), x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :],
                    mask=(cols < N)[:, None] & in_k[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    return acc


@triton.jit
def _invariant_gemm_kernel(
    x_ptr, w_ptr, out_ptr, sum_ptr, counters_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_os, stride_om,
    K_PER_SPLIT,
    SPLITS: tl.constexpr, IN_PROGRAM: tl.constexpr, LAST_PROGRAM_SUMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, PRECISION: tl.constexpr, SILU_MUL: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if IN_PROGRAM and SPLITS > 1:
        # The slices' sums added in slice order from zero: the second kernel's sum.
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for split in tl.static_range(SPLITS):
            k_start = split * K_PER_SPLIT
            acc += _slice_sum(x_ptr, w_ptr, rows, cols, M, N, K, k_start,
                              tl.minimum(k_start + K_PER_SPLIT, K), stride_xm, stride_wn,
                              BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, PRECISION, SILU_MUL)
        target = out_ptr
    else:
        # One slice: the whole K (SPLITS == 1, written as it is, as the second kernel
        # never touches it) or this program's slice (a partial for the second kernel).
        split = 0 if IN_PROGRAM else tl.program_id(2)
        k_start = split * K_PER_SPLIT
        acc = _slice_sum(x_ptr, w_ptr, rows, cols, M, N, K, k_start,
                         tl.minimum(k_start + K_PER_SPLIT, K), stride_xm, stride_wn,
                         BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, PRECISION, SILU_MUL)
        target = out_ptr + split * stride_os
    inside = (rows < M)[:, None] & (cols < N)[None, :]
    at = rows[:, None] * stride_om + cols[None, :]
    tl.store(target + at, acc.to(out_ptr.dtype.element_ty), mask=inside)
    if LAST_PROGRAM_SUMS:
        # Every thread's partial stored before the count (the CUDA threadfence
        # reduction): the release publishes them, the last program's acquire sees all.
        tl.debug_barrier()
        tile = pid_m * tl.num_programs(1) + pid_n
        done = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel")
        if done == SPLITS - 1:
            tl.debug_barrier()
            # The second kernel's sum: from zero, in slice order, in float32.
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLITS):
                total += tl.load(out_ptr + s * stride_os + at, mask=inside, other=0.0,
                                 cache_modifier=".cg")
            tl.store(sum_ptr + at, total.to(sum_ptr.dtype.element_ty), mask=inside)
            tl.atomic_xchg(counters_ptr + tile, 0)  # zero for the next launch


def invariant_gemm(x: torch.Tensor, weight: torch.Tensor,
                   launch: InvariantLaunch | None = None, *,
                   silu_mul: bool = False) -> torch.Tensor:
    """``x @ weight.T`` (``x`` ``[..., K]``, ``weight`` ``[N, K]`` contiguous along K),
    float32 accumulation, the result in ``x``'s dtype; each row's result is the same
    whatever the other rows. No host sync: capturable in a CUDA graph.

    ``silu_mul``: ``x`` is ``[..., 2K]`` = ``[gate | up]`` and the product is
    ``silu_mul_triton(x) @ weight.T``, bit for bit, the activation formed as the
    kernel loads it (a SwiGLU MLP's down projection).

    ``launch`` overrides :func:`invariant_launch` (benchmarks sweep it); launches
    with the same ``block_k`` and ``splits`` give the same bits."""
    lead, width = x.shape[:-1], x.shape[-1]
    k = width // 2 if silu_mul else width
    assert not silu_mul or width == 2 * k, "silu_mul takes [gate | up] rows"
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m, n = rows.shape[0], weight.shape[0]
    assert weight.shape[1] == k, f"x has {k} features, the weight {weight.shape[1]}"
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    if k == 0:
        return out.zero_().reshape(*lead, n)
    launch = launch or invariant_launch(m, n, k)
    splits = launch.splits
    per_split = slice_depth(k, splits, launch.block_k)
    assert triton.cdiv(k, per_split) == splits, f"{splits} slices of K = {k} leave one empty"
    partials = splits > 1 and not launch.in_program
    target = (torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if partials
              else out)
    grid = (triton.cdiv(m, launch.block_m), triton.cdiv(n, launch.block_n),
            splits if partials else 1)
    counters = (_COUNTERS.take(x.device, grid[0] * grid[1])
                if partials and launch.last_program_sums else None)
    _invariant_gemm_kernel[grid](
        rows, weight, target, out, target if counters is None else counters, m, n, k,
        rows.stride(0), weight.stride(0), target.stride(0) if partials else 0, n,
        per_split,
        SPLITS=splits, IN_PROGRAM=not partials, LAST_PROGRAM_SUMS=counters is not None,
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        NUM_STAGES=launch.num_stages, SILU_MUL=silu_mul,
        # fp32 stays fp32 (tl.dot would round it to TF32); 16-bit inputs ignore it
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=launch.num_warps,
    )  # fmt: skip
    if partials and counters is None:
        sum_splits(target, out)
    return out.reshape(*lead, n)
