"""Which kernel runs the chunked prefill: ours (Triton or torch) or fla's.

Chosen once per backend, when it is built, from the engine's ``[kernels] gdn_prefill``
(it reaches the backend as ``BackendContext.options["prefill"]``):

- ``auto`` (default): fla's ``chunk_gated_delta_rule`` where it imports and the
  layer is one it serves at our accuracy: Triton kernels on a CUDA device, a half
  model dtype (bfloat16 / float16), ``head_k_dim <= 256``. Everywhere else ours:
  Triton where the layer runs Triton, else the torch path (the CPU).
- ``ours``: never fla.
- ``fla``: fla wherever it can run at all, float32 included (its float32 products are
  TF32 on GPUs that have them); an error where it cannot, so a forced run never
  silently measures ours.

Why fla where it serves: at T = 4096 on an H200 ours takes about 3x fla's time (our
kernel does not split the state's K over programs). fla's path passes every GPU
check on the H200 (fla-core 0.6.0, triton 3.6): equality with the torch path on
varlen batches with history and PAD rows, greedy tokens equal to ours, and no host
wait in a step (which asynchronous steps rely on). Where it binds, the layer calls
fla's forward functions without the public function's training-op layers
(:mod:`kvrunner_gdn.ops.gated_delta_rule.fla_forward`), the same result at less host time.

float32 stays ours under ``auto`` because it is the dtype the engine is checked in
against the torch path and transformers token for token, and TF32 is not that.
"""

from __future__ import annotations

import torch

from kvrunner_gdn.ops.gated_delta_rule.chunk_fla import FLA_MAX_HEAD_K, fla_chunk_kernel

#: what ``[kernels] gdn_prefill`` may say
MODES = ("auto", "ours", "fla")
#: what a layer's ``prefill_kernel`` may be
KERNELS = ("torch", "triton", "fla")
#: model dtypes ``auto`` gives to fla
AUTO_DTYPES = (torch.bfloat16, torch.float16)


def _why_not_fla(*, use_triton: bool, device: torch.device, dtype: torch.dtype,
                 head_k_dim: int, forced: bool) -> str | None:
    """Why fla cannot serve this layer, or ``None`` when it can."""
    if not use_triton or device.type != "cuda":
        return f"the layer runs without Triton on CUDA (device {device.type})"
    if head_k_dim > FLA_MAX_HEAD_K:
        return f"head_k_dim {head_k_dim} > {FLA_MAX_HEAD_K}"
    if not forced and dtype not in AUTO_DTYPES:
        return f"model dtype {dtype} (auto gives fla only bfloat16/float16)"
    if fla_chunk_kernel() is None:
        return "fla (fla-core) does not import"
    return None


def choose_prefill_kernel(*, use_triton: bool, device: torch.device, dtype: torch.dtype,
                          head_k_dim: int, mode: str = "auto") -> str:
    """``"fla"``, ``"triton"`` or ``"torch"`` for a backend's layers (see the module doc).

    ``mode`` ``fla`` raises ``ValueError`` naming the reason where fla cannot serve the
    layer.
    """
    if mode not in MODES:
        raise ValueError(f"prefill mode {mode!r}; expected one of {', '.join(MODES)}")
    ours = "triton" if use_triton else "torch"
    if mode == "ours":
        return ours
    reason = _why_not_fla(use_triton=use_triton, device=torch.device(device), dtype=dtype,
                          head_k_dim=head_k_dim, forced=mode == "fla")
    if reason is None:
        return "fla"
    if mode == "fla":
        raise ValueError(f"[kernels] gdn_prefill = 'fla', but fla cannot serve this layer: "
                         f"{reason}")
    return ours
