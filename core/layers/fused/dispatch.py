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


#: seeded, unfiltered sampling rows on the Triton path take the one-pass kernel
#: (``gumbel_argmax_triton.py``) unless this is 0. From ``benchmarks/bench_sampler.py``
#: on an H200 (bf16 logits, 152k vocabulary): 0.31-0.62x the torch path's
#: time at batch 1-1,024, every token the same; the RL rollout 4% faster.
FUSED_SAMPLER_ENV = "KVRUNNER_FUSED_SAMPLER"


def fused_sampler_enabled() -> bool:
    """Whether the one-pass sampling kernel may draw (``KVRUNNER_FUSED_SAMPLER`` unset or
    1; 0 keeps the torch path). Read per call, like the other switches."""
    return os.environ.get(FUSED_SAMPLER_ENV, "1") != "0"


#: which decode projections take the skinny-GEMM kernel: ``auto`` (default) where it
#: was measured faster than cuBLAS, ``1`` every decode-sized one, ``0`` none
SKINNY_GEMM_ENV = "KVRUNNER_SKINNY_GEMM"
#: the most rows the skinny-GEMM kernel takes (a decode step's batch, not a prefill)
SKINNY_GEMM_MAX_ROWS = 64
#: ``auto``'s rule is one row (a batch-1 decode step, a one-sequence prefill's
#: logits). From ``benchmarks/bench_skinny_gemm.py --sweep`` on an H200 (bf16, the
#: 0.6B and 8B layer shapes and the 0.6B lm_head): at M = 1 the best launch took
#: 0.40-0.98x cuBLAS's time in all 9 cases, the GEMV in 8 of them (0.6B o_proj 5.3
#: vs 13.1 us; 8B gate_up's GEMV 1.00x, the tensor-core tile 0.98x); at M = 8
#: and 64 the best launch ran 0.87-1.14x, a loss in 12 of 18 cases, so more rows stay
#: with cuBLAS unless ``KVRUNNER_SKINNY_GEMM=1``. The same holds for a SwiGLU MLP's
#: down projection with its activation fused in (one launch where cuBLAS takes two):
#: ``bench_skinny_gemm.py --swiglu`` (H200, graphs of 20 launches), fused /
#: (activation + cuBLAS) 0.64 (0.6B) and 0.88 (8B) at M = 1, but 1.35-1.50 (0.6B)
#: and 2.16-3.59 (8B) at M = 8-64.


def skinny_gemm_mode() -> str:
    """``auto``, ``1`` or ``0`` from :data:`SKINNY_GEMM_ENV` (unset: ``auto``)."""
    mode = os.environ.get(SKINNY_GEMM_ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "1", "0"):
        raise ValueError(f"{SKINNY_GEMM_ENV}={mode!r}; expected auto, 1 or 0")
    return mode


def use_skinny_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` should take the skinny-GEMM kernel: the mode allows
    these rows (``auto``: one; ``1``: at most :data:`SKINNY_GEMM_MAX_ROWS`), one kernel
    dtype, a weight contiguous along K, and the Triton path taken for ``x``."""
    mode = skinny_gemm_mode()
    if mode == "0" or x.dim() == 0:
        return False
    rows = x.numel() // max(1, x.shape[-1])
    return (
        rows <= (1 if mode == "auto" else SKINNY_GEMM_MAX_ROWS)
        and same_kernel_dtype(x, weight)
        and weight.dim() == 2
        and weight.stride(-1) == 1
        and use_triton(x)
    )
