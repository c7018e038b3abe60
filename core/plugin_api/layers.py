"""What a model layer expects from the backend object ``make_layer`` returns.

The model owns projections, norms and rotary; the backend owns the cache and the
kernels that read and write it. These protocols are the seam between the two.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvrunner.plugin_api.step_data import ForwardContext


class FullAttentionImpl(Protocol):
    """Softmax attention over a KV cache (layer type ``full_attention``)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Store ``k``/``v`` for this step, then attend causally over the cache.

        :param q: ``[num_tokens, num_heads, head_dim]`` after rotary.
        :param k: ``[num_tokens, num_kv_heads, head_dim]`` after rotary.
        :param v: ``[num_tokens, num_kv_heads, head_dim]``.
        :returns: ``[num_tokens, num_heads, head_dim]``; scale is ``head_dim ** -0.5``.
        """
        ...


class KVScaleLoading(Protocol):
    """Optional on a full-attention layer object: it takes the FP8 KV-cache scales a
    checkpoint or a weight update carries (``self_attn.k_scale`` / ``v_scale`` and the
    other names of :mod:`kvrunner.models.kv_scale_names`). The model routes them here,
    this rank's KV heads' part; a layer object without these methods never sees them
    (the names still load, as no-ops)."""

    def check_kv_scale(self, which: str, scale: torch.Tensor) -> None:
        """Raise ``ValueError`` for a scale :meth:`load_kv_scale` would refuse by its
        shape (a dry run: ``scale`` may be a meta tensor, without values)."""
        ...

    def load_kv_scale(self, which: str, scale: torch.Tensor) -> None:
        """Set the key (``which="k"``) or value scales: ``scale`` is one number (per
        tensor) or ``[num_kv_heads]`` of this rank. In place, so a captured graph
        replays with it; ``ValueError`` for a bad one, changing nothing."""
        ...


class LinearAttentionImpl(Protocol):
    """Gated-DeltaNet state (layer type ``linear_attention``): causal conv + delta rule.

    The model keeps the projections, the decay and gates, the gated norm and the
    output projection; the backend's object owns the conv state and the recurrent
    state of every request slot.
    """

    #: channels of ``mixed_qkv``: ``2 * key_dim + value_dim``
    conv_dim: int
    #: ``num_key_heads * head_k_dim`` (per rank)
    key_dim: int
    #: ``num_value_heads * head_v_dim`` (per rank)
    value_dim: int

    def forward(
        self,
        mixed_qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        conv_weight: torch.Tensor,
        conv_bias: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """Conv + SiLU over each sequence's history, split, q/k L2 norm, gated delta rule.

        :param mixed_qkv: ``[num_tokens, conv_dim]``, channels ``[q | k | v]`` head-major.
        :param g: ``[num_tokens, num_value_heads]`` float32 log-decay (<= 0).
        :param beta: ``[num_tokens, num_value_heads]`` in (0, 1).
        :param conv_weight: ``[conv_dim, kernel]`` (or ``[conv_dim, 1, kernel]``).
        :param conv_bias: ``[conv_dim]`` or ``None``.
        :returns: ``[num_tokens, num_value_heads, head_v_dim]`` in ``mixed_qkv``'s dtype;
            padded rows are zeros. Value head ``h`` reads key head ``h // (Hv // Hk)``;
            q is scaled by ``head_k_dim ** -0.5`` after its L2 norm.
        """
        ...
