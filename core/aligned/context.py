"""The process state an aligned forward runs in: the engine's kernel choices and
batch invariance, and the checks that the trainer's device and threads give the
engine's kernels."""

from __future__ import annotations

import contextlib

import attrs
import torch

from kvrunner.aligned.plan import AlignedPlan
from kvrunner.aligned.rules import AlignmentError
from kvrunner.layers.fused.dispatch import batch_invariance, kernels_chosen


def aligned_context(plan: AlignedPlan, device: torch.device) -> contextlib.ExitStack:
    """The engine's kernel choices and batch invariance for the block; refuses a device
    whose kernels are not the engine's, and (CPU) torch threads other than one."""
    triton = device.type == "cuda" or plan.kernels.triton_on_cpu
    if plan.engine_triton is not None and triton != plan.engine_triton:
        raise AlignmentError(
            f"aligned forward: the trainer's tensors are on {device.type}, where the layers "
            f"{'launch' if triton else 'do not launch'} Triton, and the engine's "
            f"{'do' if plan.engine_triton else 'do not'}: the kernels would differ")
    if device.type == "cpu" and torch.get_num_threads() != 1:
        raise AlignmentError(
            f"aligned forward: torch runs {torch.get_num_threads()} CPU threads; deterministic "
            "mode's CPU kernels need one (torch.set_num_threads(1), as the engine sets it)")
    stack = contextlib.ExitStack()
    stack.enter_context(batch_invariance(True))
    stack.enter_context(kernels_chosen(**attrs.asdict(plan.kernels)))
    return stack
