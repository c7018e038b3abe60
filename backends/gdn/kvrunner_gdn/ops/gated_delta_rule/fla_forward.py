"""fla's chunked gated-delta-rule forward, called without its training-op layers.

fla's public ``chunk_gated_delta_rule`` is built for training. Every call passes a
backend dispatcher (a ``torch.compiler.disable`` wrapper around a scan of registered
backends, repeated for each of the six forward calls it makes), an input guard
(a contiguity check per argument and a device context), and an autograd
``Function`` that saves its inputs for a backward. Apart from the guard's copies of
non-contiguous inputs (which the direct forward makes too), none of it launches a
kernel, and at T = 4096 on an H200 the host already needs about 1 ms to launch fla's
285 µs of kernels, so those layers set a prefill's wall time.

:func:`fla_direct_forward` binds the forward functions fla's own forward runs (L2
norm, the gates' chunk-local cumsum, the intra-chunk WY representation, the
inter-chunk state scan, the output) with their dispatch and guard wrappers removed,
and calls them in fla's order with fla's arguments, so the result is the public
call's bit for bit (a GPU test checks it on varlen batches with initial states).

It binds only where that holds by construction: an fla version this module was
checked against (:data:`CHECKED_VERSIONS`), every function with the parameters it
passes, and no other fla backend (FlashQLA, TileLang, ...) active for any of them,
since the dispatcher would hand the public call to that backend. Elsewhere it
returns ``None`` and the public call serves.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

#: fla-core versions whose forward this composition was checked against on the GPU
CHECKED_VERSIONS = ("0.6.0",)

#: (module, function, parameters this module passes) for each forward piece
_PIECES = {
    "l2norm": ("fla.modules.norm.l2norm", "l2norm_fwd", ("x",)),
    "cumsum": ("fla.ops.utils.cumsum", "chunk_local_cumsum",
               ("g", "chunk_size", "scale", "cu_seqlens", "chunk_indices")),
    "intra": ("fla.ops.gated_delta_rule.chunk_fwd", "chunk_gated_delta_rule_fwd_intra",
              ("k", "v", "g", "beta", "cu_seqlens", "chunk_indices", "chunk_size")),
    "state": ("fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_fwd_h",
              ("k", "w", "u", "g", "initial_state", "output_final_state", "cu_seqlens",
               "chunk_indices", "chunk_size", "chunk_offsets")),
    "output": ("fla.ops.common.chunk_o", "chunk_fwd_o",
               ("q", "k", "v", "h", "g", "scale", "cu_seqlens", "chunk_indices",
                "chunk_size")),
}


def _raw(module: str, name: str, params: tuple[str, ...]) -> Callable[..., Any] | None:
    """The function under its wrappers, if it takes every parameter in ``params``."""
    fn = inspect.unwrap(getattr(importlib.import_module(module), name))
    have = inspect.signature(fn).parameters
    return fn if all(p in have for p in params) else None


def _another_backend_active(wrapped: list[Callable[..., Any]]) -> bool:
    """Whether fla's dispatcher would give any of these calls to a backend of its own."""
    from fla import backends

    registries = [backends._load_operation_registry(op) for op in ("gated_delta_rule", "common")]
    registries += [backends._function_registries.get(inspect.unwrap(fn)) for fn in wrapped]
    return any(r is not None and r.get_active() is not None for r in registries)


class FlaDirectForward:
    """``chunk_gated_delta_rule``'s forward with the keyword arguments the prefill
    wrapper passes (:mod:`kvrunner_gdn.ops.gated_delta_rule.chunk_fla`); returns ``(o,
    final_state)`` as the public call does.

    One more than the public call takes: ``chunk_offsets`` (each sequence's first chunk,
    ``[N + 1]`` int64), which fla's state scan otherwise computes from ``cu_seqlens``
    on the device in four small launches; the wrapper copies it from the host with
    the chunk map."""

    def __init__(self, pieces: dict[str, Callable[..., Any]], gate_scale: float,
                 chunk_map: Callable[..., torch.Tensor]) -> None:
        #: fla scans the gates in base 2: its cumsum scales them by this (1 / ln 2)
        self.gate_scale = gate_scale
        #: fla's ``prepare_chunk_indices``, for a varlen call given no chunk map
        self.chunk_map = chunk_map
        self.l2norm = pieces["l2norm"]
        self.cumsum = pieces["cumsum"]
        self.intra = pieces["intra"]
        self.state = pieces["state"]
        self.output = pieces["output"]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, *, scale: float, output_final_state: bool,
                 use_qk_l2norm_in_kernel: bool, chunk_size: int,
                 initial_state: torch.Tensor | None = None,
                 cu_seqlens: torch.Tensor | None = None,
                 chunk_indices: torch.Tensor | None = None,
                 chunk_offsets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if cu_seqlens is not None and chunk_indices is None:
            # as the public call does (fla reads the offsets on the host: a sync)
            chunk_indices = self.chunk_map(cu_seqlens, chunk_size)
        # What the input guard did: fla's kernels index dense [B, T, H, D] tensors, and
        # launch on the current device.
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
        if initial_state is not None:
            initial_state = initial_state.contiguous()
        seq = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_size=chunk_size)
        run = functools.partial(self._forward, q, k, v, g, beta, scale, output_final_state,
                                use_qk_l2norm_in_kernel, initial_state, seq, chunk_offsets)
        if q.device.index == torch.cuda.current_device():
            return run()
        with torch.cuda.device(q.device):
            return run()

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, scale: float, output_final_state: bool, l2norm: bool,
                 initial_state: torch.Tensor | None, seq: dict[str, Any],
                 chunk_offsets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """fla's ``chunk_gated_delta_rule_fwd`` order (gates given in log space, state
        K-first, no context parallelism), after its L2 norm of q and k."""
        if l2norm:
            q, k = self.l2norm(q)[0], self.l2norm(k)[0]
        g = self.cumsum(g, scale=self.gate_scale, **seq)
        w, u, _ = self.intra(k=k, v=v, g=g, beta=beta, **seq)
        h, v_new, final = self.state(k=k, w=w, u=u, g=g, initial_state=initial_state,
                                     output_final_state=output_final_state,
                                     chunk_offsets=chunk_offsets, **seq)
        o = self.output(q=q, k=k, v=v_new, h=h, g=g, scale=scale, **seq)
        return o.to(q.dtype), final


def fla_direct_forward() -> FlaDirectForward | None:
    """The direct forward where it binds (see the module docstring), else ``None``."""
    try:
        import fla

        if fla.__version__ not in CHECKED_VERSIONS:
            return None
        from fla.ops.utils.constant import RCP_LN2
        from fla.ops.utils.index import prepare_chunk_indices

        wrapped, pieces = [], {}
        for key, (module, name, params) in _PIECES.items():
            wrapped.append(getattr(importlib.import_module(module), name))
            pieces[key] = _raw(module, name, params)
        if any(p is None for p in pieces.values()) or _another_backend_active(wrapped):
            return None
        return FlaDirectForward(pieces, RCP_LN2, prepare_chunk_indices)
    except Exception:  # fla absent, or laid out otherwise than the versions checked
        return None
