"""Fused Triton kernels for the per-layer elementwise work, with their dispatch.

Each kernel replaces a chain of small torch ops whose launch count (not bytes)
dominated a decode step: (residual add +) RMSNorm, per-head q/k norm + rotary, and
SiLU-and-mul. The modules in ``kvrunner.layers`` keep the torch code as their CPU
path and the reference; :func:`use_triton` decides per call. The ``*_triton``
modules import triton, so they are imported only when a kernel is about to run.
"""

from kvrunner.layers.fused.dispatch import kernels_chosen, same_kernel_dtype, use_triton
from kvrunner.layers.fused.qk_norm_rope import qk_norm_rope

__all__ = ["kernels_chosen", "qk_norm_rope", "same_kernel_dtype", "use_triton"]
