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
