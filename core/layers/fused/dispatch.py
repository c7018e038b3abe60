"""When the model layers take their Triton path instead of the plain-torch one, and
which of several kernels serves an op.

The rule: Triton on CUDA tensors, and on CPU tensors too under ``[kernels]
triton_on_cpu`` (tests set it and run the kernels under ``TRITON_INTERPRET=1``). The
torch path is the reference every kernel is checked against, so it stays the default
wherever Triton cannot run.

The layers ask per op, with no engine at hand, so the choice is the process's: each
runner installs its config's ``[kernels]`` when it is built (:func:`choose_kernels`),
on every rank, and tests switch it for a block with :func:`kernels_chosen`. Inside a
captured graph the question costs nothing: it was answered at capture.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import attrs
import torch

from kvrunner.config import KernelsConfig

_chosen = KernelsConfig()
#: whether the layers take their batch-invariant paths (``EngineConfig.deterministic``)
_batch_invariant = False


def chosen_kernels() -> KernelsConfig:
    """The kernel choices this process's layers follow now."""
    return _chosen


def choose_kernels(kernels: KernelsConfig) -> None:
    """Make ``kernels`` the choices this process's layers follow (a runner's config)."""
    global _chosen
    _chosen = kernels


def batch_invariant() -> bool:
    """Whether the layers compute every row as it would be computed alone: products,
    experts and attention in one fixed order for any batch (``layers/batch_invariant.py``)."""
    return _batch_invariant


def choose_batch_invariance(enabled: bool) -> None:
    """Make the layers take (or leave) their batch-invariant paths (a runner's
    ``deterministic``)."""
    global _batch_invariant
    _batch_invariant = enabled


@contextlib.contextmanager
def batch_invariance(enabled: bool = True) -> Iterator[None]:
    """The batch-invariant paths on (or off) for the block; the choice before it comes
    back afterwards, also when the block raises."""
    before = _batch_invariant
    choose_batch_invariance(enabled)
    try:
        yield
    finally:
        choose_batch_invariance(before)


@contextlib.contextmanager
def kernels_chosen(**changes: Any) -> Iterator[KernelsConfig]:
    """The current choices with ``changes`` (``KernelsConfig`` field names) for the block;
    the choices before it come back afterwards, also when the block raises."""
    before = _chosen
    choose_kernels(attrs.evolve(before, **changes))
    try:
        yield _chosen
    finally:
        choose_kernels(before)


#: float dtypes the kernels are written for; anything else takes the torch path
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: widest row one RMSNorm program holds in registers; wider rows take the torch path
MAX_NORM_ROW = 8192


@functools.cache
def triton_available() -> bool:
    """Whether ``triton`` imports (it is an optional dependency)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op on ``x`` should launch its Triton kernel (see the module doc)."""
    if not (x.is_cuda or _chosen.triton_on_cpu):
        return False
    return triton_available()


def same_kernel_dtype(*tensors: torch.Tensor) -> bool:
    """All tensors share one dtype the kernels handle (mixed dtypes go to torch,
    whose type promotion the kernels do not reproduce)."""
    dtype = tensors[0].dtype
    return dtype in KERNEL_DTYPES and all(t.dtype == dtype for t in tensors)


def fused_sampler_enabled() -> bool:
    """Whether the one-pass sampling kernel may draw (``[kernels] fused_sampler``).

    From ``benchmarks/bench_sampler.py`` on an H200 (bf16 logits, 152k vocabulary):
    0.31-0.62x the torch path's time at batch 1-1,024, every token the same."""
    return _chosen.fused_sampler


#: the most rows the skinny-GEMM kernel takes (a decode step's batch, not a prefill)
SKINNY_GEMM_MAX_ROWS = 64
#: ``auto``'s rule is one row (a batch-1 decode step, a one-sequence prefill's
#: logits). From ``benchmarks/bench_skinny_gemm.py --sweep`` on an H200 (bf16, the
#: 0.6B and 8B layer shapes and the 0.6B lm_head): at M = 1 the best launch took
#: 0.40-0.98x cuBLAS's time in all 9 cases, the GEMV in 8 of them (0.6B o_proj 5.3
#: vs 13.1 us; 8B gate_up's GEMV 1.00x, the tensor-core tile 0.98x); at M = 8
#: and 64 the best launch ran 0.87-1.14x, a loss in 12 of 18 cases, so more rows stay
#: with cuBLAS unless ``[kernels] skinny_gemm = "on"``. The same holds for a SwiGLU MLP's
#: down projection with its activation fused in (one launch where cuBLAS takes two):
#: ``bench_skinny_gemm.py --swiglu`` (H200, graphs of 20 launches), fused /
#: (activation + cuBLAS) 0.64 (0.6B) and 0.88 (8B) at M = 1, but 1.35-1.50 (0.6B)
#: and 2.16-3.59 (8B) at M = 8-64.


def use_skinny_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` should take the skinny-GEMM kernel: the mode allows
    these rows (``[kernels] skinny_gemm``: ``auto`` one; ``on`` at most
    :data:`SKINNY_GEMM_MAX_ROWS`), one kernel dtype, a weight contiguous along K, and
    the Triton path taken for ``x``."""
    mode = _chosen.skinny_gemm
    if mode == "off" or x.dim() == 0:
        return False
    rows = x.numel() // max(1, x.shape[-1])
    return (
        rows <= (1 if mode == "auto" else SKINNY_GEMM_MAX_ROWS)
        and same_kernel_dtype(x, weight)
        and weight.dim() == 2
        and weight.stride(-1) == 1
        and use_triton(x)
    )
