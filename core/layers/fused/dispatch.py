"""When the model layers take their Triton path instead of the plain-torch one.

The rule is the runner's: Triton on CUDA tensors, and on CPU tensors too when
``KVRUNNER_USE_TRITON=1`` (tests set it and run the kernels under
``TRITON_INTERPRET=1``). The torch path is the reference every kernel is checked
against, so it stays the default wherever Triton cannot run.
"""

from __future__ import annotations

import functools
import os

import torch

#: set to 1 to run the fused Triton kernels on CPU tensors (under TRITON_INTERPRET=1)
USE_TRITON_ENV = "KVRUNNER_USE_TRITON"

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
    """Whether an op on ``x`` should launch its Triton kernel.

    The environment is read on every call (a dict lookup) so tests can switch paths
    with ``monkeypatch.setenv``; inside a captured graph this costs nothing.
    """
    if not (x.is_cuda or os.environ.get(USE_TRITON_ENV) == "1"):
        return False
    return triton_available()


def same_kernel_dtype(*tensors: torch.Tensor) -> bool:
    """All tensors share one dtype the kernels handle (mixed dtypes go to torch,
    whose type promotion the kernels do not reproduce)."""
    dtype = tensors[0].dtype
    return dtype in KERNEL_DTYPES and all(t.dtype == dtype for t in tensors)


#: which decode projections take the skinny-GEMM kernel: ``auto`` (default) where it
#: was measured faster than cuBLAS, ``1`` every decode-sized one, ``0`` none
SKINNY_GEMM_ENV = "KVRUNNER_SKINNY_GEMM"
#: the most rows the skinny-GEMM kernel takes (a decode step's batch, not a prefill)
SKINNY_GEMM_MAX_ROWS = 64
#: ``auto``'s rule: one row and a reduction at least this deep. From
#: ``benchmarks/bench_skinny_gemm.py`` on an H200 (2026-12-01, 24 bf16 projections of
#: the 0.6B and 8B shapes at M = 1, 8, 64): every M = 1 case with K >= 2048 ran at
#: 0.54-0.99x cuBLAS's time (0.6B o_proj 7.1 vs 13.0 us); every shallower one, and
#: most M >= 8 cases, ran slower (up to 1.58x).
SKINNY_GEMM_AUTO_MIN_K = 2048


def skinny_gemm_mode() -> str:
    """``auto``, ``1`` or ``0`` from :data:`SKINNY_GEMM_ENV` (unset: ``auto``)."""
    mode = os.environ.get(SKINNY_GEMM_ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "1", "0"):
        raise ValueError(f"{SKINNY_GEMM_ENV}={mode!r}; expected auto, 1 or 0")
    return mode


def use_skinny_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` should take the skinny-GEMM kernel: the mode allows
    these rows (``auto``: one row, K >= :data:`SKINNY_GEMM_AUTO_MIN_K`; ``1``: at most
    :data:`SKINNY_GEMM_MAX_ROWS`), one kernel dtype, a weight contiguous along K, and
    the Triton path taken for ``x``."""
    mode = skinny_gemm_mode()
    if mode == "0" or x.dim() == 0:
        return False
    k = x.shape[-1]
    rows = x.numel() // max(1, k)
    if mode == "auto":
        fits = rows == 1 and k >= SKINNY_GEMM_AUTO_MIN_K
    else:
        fits = rows <= SKINNY_GEMM_MAX_ROWS
    return (
        fits
        and same_kernel_dtype(x, weight)
        and weight.dim() == 2
        and weight.stride(-1) == 1
        and use_triton(x)
    )
