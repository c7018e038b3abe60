"""What a model layer expects from the backend object ``make_layer`` returns.

The model owns projections, norms and rotary; the backend owns the cache and the
kernels that read and write it. These protocols are the seam between the two.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvrunner.contract import ForwardContext


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
