"""An op whose forward is the engine's kernel and whose backward is a plain-torch
reference's gradient.

The engine's deterministic kernels (Triton launches on CUDA, row-by-row products on
the CPU) give the bits the rollout engine gives, but Triton kernels have no autograd
and the CPU's row loops would record one node per row. :func:`engine_op` runs the
kernel with autograd off, keeps the inputs, and in the backward pass recomputes the
op with ordinary differentiable torch code (the ``reference``: the same function in
exact arithmetic) and takes that code's vector-Jacobian product. The forward is the
engine's to the bit; the gradient is the reference's, which equals the exact
gradient up to the rounding of its own steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

Outputs = torch.Tensor | tuple[torch.Tensor, ...]


class _EngineOp(torch.autograd.Function):
    """``kernel(*tensors)`` forward; the gradient of ``reference(*tensors)`` backward."""

    @staticmethod
    def forward(ctx: Any, kernel: Callable[..., Outputs], reference: Callable[..., Outputs],
                *tensors: torch.Tensor) -> Outputs:
        ctx.reference = reference
        ctx.save_for_backward(*tensors)
        out = kernel(*tensors)
        outs = out if isinstance(out, tuple) else (out,)
        # routing ids and the like carry no gradient
        ctx.mark_non_differentiable(*(o for o in outs if not o.is_floating_point()))
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        needs = ctx.needs_input_grad[2:]
        inputs = [t.detach().requires_grad_(need and t.is_floating_point())
                  for t, need in zip(ctx.saved_tensors, needs, strict=True)]
        with torch.enable_grad():
            ref = ctx.reference(*inputs)
        refs = ref if isinstance(ref, tuple) else (ref,)
        pairs = [(r, g) for r, g in zip(refs, grads, strict=True)
                 if g is not None and r.requires_grad]
        wanted = [t for t in inputs if t.requires_grad]
        found: Sequence[torch.Tensor | None] = ()
        if pairs and wanted:
            found = torch.autograd.grad([r for r, _ in pairs], wanted, [g for _, g in pairs],
                                        allow_unused=True)
        by_input = iter(found)
        return (None, None, *(next(by_input) if t.requires_grad else None for t in inputs))


def engine_op(kernel: Callable[..., Outputs], reference: Callable[..., Outputs],
              *tensors: torch.Tensor) -> Outputs:
    """``kernel(*tensors)`` with the gradient of ``reference(*tensors)``.

    Both take the same tensors (everything else goes in by closure) and return a
    tensor or a tuple of tensors in the same order; integer outputs are not
    differentiable. Without autograd in play the kernel runs alone."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        with torch.no_grad():
            return kernel(*tensors)
    return _EngineOp.apply(kernel, reference, *tensors)
