"""GDN kernels: per op a Triton launcher and a plain-torch path, plus naive oracles.

Triton modules (``conv_update``, ``conv_prefill``, ``recurrent_decode``,
``chunked_prefill``) are imported only where Triton runs; the torch paths
(``conv_torch``, ``recurrent_decode_torch``, ``chunked_prefill_torch``) and
``reference`` (the naive fp32 token-by-token oracles) never import Triton, so the
backend serves on a machine without it. ``fla_prefill`` runs the chunked prefill
through flash-linear-attention (optional; fla is imported only when it is chosen).
"""
