"""The object ``make_layer`` returns for a ``linear_attention`` layer: the GDN core.

Division of labour with the model (Qwen3-Next ``Qwen3NextGatedDeltaNet``):

The **model** owns the weights and everything that has no state: ``in_proj_qkvz`` /
``in_proj_ba`` and their per-key-head un-interleaving into q, k, v, z, b, a; the
decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (float32) and ``beta =
sigmoid(b)``; the gated RMSNorm with ``z``; ``out_proj``.

The **layer** owns the state: the causal conv over ``mixed_qkv`` with SiLU (conv
state in the pool), the split into q/k/v, q/k L2 norm and the ``1/sqrt(head_k_dim)``
query scale, and the gated delta rule (recurrent state in the pool): the decode
kernel for pure-decode steps, the chunked prefill for everything else (ours, or
fla's where :mod:`kvrunner_gdn.prefill_choice` picks it).

Call::

    core_attn_out = layer.forward(mixed_qkv, g, beta, conv_weight, conv_bias, ctx)

- ``mixed_qkv``: ``[T, conv_dim]``, channels ``[q (Hk*K) | k (Hk*K) | v (Hv*V)]``,
  each head-major (head ``i`` of q is columns ``i*K:(i+1)*K``), i.e. exactly HF's
  ``torch.cat((query, key, value), -1)`` before its conv; any float dtype; the
  last dimension must be contiguous.
- ``g``: ``[T, Hv]`` log-decay, float32 (values <= 0).
- ``beta``: ``[T, Hv]`` in (0, 1), any float dtype.
- ``conv_weight``: ``[conv_dim, kernel]`` (or HF's ``conv1d.weight`` ``[conv_dim, 1,
  kernel]``); ``conv_bias``: ``[conv_dim]`` or ``None`` (Qwen3-Next has none).
- ``ctx``: the step's :class:`~kvrunner.plugin_api.step_data.ForwardContext`.
- returns ``[T, Hv, head_v_dim]`` in ``mixed_qkv``'s dtype: the input of the gated
  norm. Rows of padded (PAD) tokens are zeros.

Value head ``h`` reads key head ``h // (Hv // Hk)`` (HF's ``repeat_interleave``).
Token rows follow the step's sequence order (``StepBatch.cu_query_lens``); in a
decode step ``T`` may be the padded batch size of a captured graph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from kvrunner.plugin_api import ForwardContext
from kvrunner_gdn.metadata import GDNMetadata
from kvrunner_gdn.ops.gated_delta_rule.chunk_fla import chunk_gated_delta_rule_fla, fla_chunk_kernel
from kvrunner_gdn.ops.gated_delta_rule.chunk_torch import chunk_gated_delta_rule_torch
from kvrunner_gdn.ops.gated_delta_rule.fused_recurrent_torch import (
    fused_recurrent_gated_delta_rule_torch,
)
from kvrunner_gdn.ops.gated_delta_rule.inputs import GatedDeltaRuleInputs
from kvrunner_gdn.ops.short_conv.inputs import ShortConvInputs
from kvrunner_gdn.ops.short_conv.prefill_torch import short_conv_prefill_torch
from kvrunner_gdn.ops.short_conv.update_torch import short_conv_update_torch
from kvrunner_gdn.ops.utils import DEFAULT_CHUNK
from kvrunner_gdn.prefill_choice import KERNELS
from kvrunner_gdn.state import GDNShapes, GDNStatePool


class GDNLayer:
    """Conv + gated delta rule of one model layer, with its state in the backend's pool.

    Implements :class:`kvrunner.plugin_api.layers.LinearAttentionImpl`. Kernels are
    chosen once, at construction: the Triton launchers when ``use_triton`` (compiled
    on CUDA, interpreted under ``TRITON_INTERPRET=1``), else the plain-torch path.
    ``prefill_kernel`` (``"torch"``, ``"triton"`` or ``"fla"``, see
    :mod:`kvrunner_gdn.prefill_choice`; by default the one ``use_triton`` implies)
    names the chunked prefill's, and stays readable on the layer.
    """

    def __init__(
        self,
        *,
        layer_index: int,
        backend_name: str,
        shapes: GDNShapes,
        pool: GDNStatePool,
        use_triton: bool,
        chunk_size: int = DEFAULT_CHUNK,
        prefill_kernel: str | None = None,
    ) -> None:
        self.layer_index = layer_index
        self.backend_name = backend_name
        self.shapes = shapes
        self.pool = pool
        self.use_triton = use_triton
        self.chunk_size = chunk_size
        self.scale = shapes.head_k_dim**-0.5
        #: the conv's channels: q, k, v
        self._sections = (shapes.key_dim, shapes.key_dim, shapes.value_dim)
        # Every op entry takes one inputs record, keyword-only.
        self._conv_update: Callable[..., torch.Tensor] = short_conv_update_torch
        self._conv_prefill: Callable[..., torch.Tensor] = short_conv_prefill_torch
        #: the prefill conv as (q, k, v): column slices of its output, which ours take
        self._conv_prefill_qkv: Callable[..., tuple[torch.Tensor, ...]] = (
            self._conv_prefill_columns)
        self._decode: Callable[..., torch.Tensor] = fused_recurrent_gated_delta_rule_torch
        self._prefill: Callable[..., torch.Tensor] = chunk_gated_delta_rule_torch
        if use_triton:
            # Imported here so the torch path never needs Triton installed.
            from kvrunner_gdn.ops.gated_delta_rule.chunk import chunk_gated_delta_rule
            from kvrunner_gdn.ops.gated_delta_rule.fused_recurrent import (
                fused_recurrent_gated_delta_rule,
            )
            from kvrunner_gdn.ops.short_conv.prefill import short_conv_prefill
            from kvrunner_gdn.ops.short_conv.update import short_conv_update

            self._conv_update = short_conv_update
            self._conv_prefill = short_conv_prefill
            self._decode = fused_recurrent_gated_delta_rule
            self._prefill = chunk_gated_delta_rule
        self.prefill_kernel = prefill_kernel or ("triton" if use_triton else "torch")
        if self.prefill_kernel not in KERNELS or (self.prefill_kernel != "torch") != use_triton:
            raise ValueError(f"prefill_kernel {self.prefill_kernel!r} with use_triton={use_triton}")
        if self.prefill_kernel == "fla":
            from kvrunner_gdn.ops.short_conv.prefill import short_conv_prefill_split

            # Bound once: the import is looked up here, never on the hot path.
            kernel = fla_chunk_kernel()
            if kernel is None:
                raise RuntimeError("prefill_kernel 'fla', but fla (fla-core) does not import")
            self._prefill = functools.partial(chunk_gated_delta_rule_fla, kernel=kernel)
            # fla's kernels index dense tensors: the conv writes q, k and v apart, so none
            # of them is copied on the way in
            self._conv_prefill_qkv = functools.partial(short_conv_prefill_split,
                                                       sections=self._sections)

    def _conv_prefill_columns(self, *, inputs: ShortConvInputs) -> tuple[torch.Tensor, ...]:
        """The prefill conv's ``[T, conv_dim]`` output as q, k, v column slices."""
        return self._conv_prefill(inputs=inputs).split(self._sections, 1)

    # Shapes the model needs to lay out its projections.
    @property
    def conv_dim(self) -> int:
        return self.shapes.conv_dim

    @property
    def key_dim(self) -> int:
        return self.shapes.key_dim

    @property
    def value_dim(self) -> int:
        return self.shapes.value_dim

    def _check(self, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               weight: torch.Tensor) -> None:
        sh = self.shapes
        tokens = mixed_qkv.shape[0]
        if mixed_qkv.dim() != 2 or mixed_qkv.shape[1] != sh.conv_dim:
            raise ValueError(f"mixed_qkv must be [T, {sh.conv_dim}], got {tuple(mixed_qkv.shape)}")
        if g.shape != (tokens, sh.num_value_heads) or beta.shape != g.shape:
            raise ValueError(
                f"g and beta must be [{tokens}, {sh.num_value_heads}], "
                f"got {tuple(g.shape)} and {tuple(beta.shape)}"
            )
        if weight.shape != (sh.conv_dim, sh.conv_kernel):
            raise ValueError(
                f"conv_weight must be [{sh.conv_dim}, {sh.conv_kernel}], got {tuple(weight.shape)}"
            )

    def forward(
        self,
        mixed_qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        conv_weight: torch.Tensor,
        conv_bias: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """Conv + SiLU, split, L2 norm, gated delta rule; see the module docstring."""
        weight = conv_weight.squeeze(1) if conv_weight.dim() == 3 else conv_weight
        self._check(mixed_qkv, g, beta, weight)
        md = ctx.for_backend(self.backend_name, GDNMetadata)
        conv_state, ssm_state = self.pool.layer(self.layer_index)
        sh = self.shapes
        tokens = mixed_qkv.shape[0]
        if md.is_decode:
            if tokens > md.num_rows:
                raise ValueError(f"{tokens} decode tokens but metadata for {md.num_rows} rows")
            # Rows past the real batch are PAD in both index views: they do nothing.
            read, write = md.read_indices[:tokens], md.write_indices[:tokens]
            x = self._conv_update(inputs=ShortConvInputs(
                x=mixed_qkv, conv_state=conv_state, weight=weight, bias=conv_bias,
                read_indices=read, write_indices=write))
            qx, kx, vx = x.split(self._sections, 1)
        else:
            read, write = md.read_indices, md.write_indices
            # Where the host knows the step covers every row, the conv's output needs no
            # zeroing first.
            qx, kx, vx = self._conv_prefill_qkv(inputs=ShortConvInputs(
                x=mixed_qkv, conv_state=conv_state, weight=weight, bias=conv_bias,
                read_indices=read, write_indices=write, cu_seqlens=md.cu_seqlens,
                max_seqlen=md.max_seqlen,
                total_tokens=md.cu_seqlens_host[-1] if md.cu_seqlens_host else None))
        heads = dict(
            q=qx.unflatten(1, (sh.num_key_heads, sh.head_k_dim)),
            k=kx.unflatten(1, (sh.num_key_heads, sh.head_k_dim)),
            v=vx.unflatten(1, (sh.num_value_heads, sh.head_v_dim)),
            g=g, beta=beta, state=ssm_state, read_indices=read, write_indices=write,
            scale=self.scale,
        )
        if md.is_decode:
            return self._decode(inputs=GatedDeltaRuleInputs(**heads))
        return self._prefill(inputs=GatedDeltaRuleInputs(
            **heads, cu_seqlens=md.cu_seqlens, chunk_size=self.chunk_size,
            # what the Triton and fla paths read on the host instead of the device
            cu_seqlens_host=md.cu_seqlens_host or None,
            # fla plans its call on the host indices
            host_indices=(md.read_host, md.write_host) if md.read_host else None,
        ))

    __call__ = forward
