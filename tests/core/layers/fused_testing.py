"""Helpers for the fused-kernel tests: switching paths and comparing their outputs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvrunner.layers.fused import kernels_chosen

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: the arithmetic the torch paths of the norms, rotary and SiLU-and-mul issue; the
#: Triton paths must issue none of it (the interpreter only allocates and copies)
TORCH_MATH_OPS = frozenset(
    {"aten::pow", "aten::rsqrt", "aten::mean", "aten::silu", "aten::cat", "aten::add",
     "aten::mul", "aten::sub"}
)


@contextmanager
def triton_path(on: bool) -> Iterator[None]:
    """Run the layers' Triton kernels (``on``) or their torch code, then restore."""
    with kernels_chosen(triton_on_cpu=on):
        yield


#: spacing of representable values relative to their magnitude (upper bound)
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def assert_same_values(actual: torch.Tensor, expected: torch.Tensor, *, roundings: int,
                       scale: float = 0.0) -> None:
    """Triton output vs torch-path output of the same dtype and shape.

    float32: torch's default tolerance (the paths differ only in float32 summation
    order and rsqrt/exp rounding). bf16/fp16: one step of the dtype per rounding to
    it along the way: each may land one step apart, since the float32 statistics
    differ in their last bit and the Triton interpreter truncates float32 -> bf16
    where CUDA and torch round to nearest.

    :param roundings: how many times the value is rounded to the dtype on its way.
    :param scale: magnitude of the operands of a difference (rotary's
        ``x1*cos - x2*sin``): a step in an operand moves an output that cancels to
        near zero by up to a step *of the operand*; 0 where nothing cancels.
    """
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    dtype = actual.dtype
    rtol = 1.3e-6 if dtype == torch.float32 else roundings * ULP[dtype]
    atol = max(1e-5, roundings * ULP[dtype] * scale)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def operand_scale(*tensors: torch.Tensor) -> float:
    """The largest magnitude among ``tensors``, as a float."""
    return max(float(t.float().abs().max()) for t in tensors)
