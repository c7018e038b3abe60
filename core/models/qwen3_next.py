"""Qwen3-Next (``Qwen3NextForCausalLM``): hybrid Gated-DeltaNet + gated full attention.

Layer types come from the config: ``linear_attention`` layers hand their conv and
delta-rule recurrence to the backend selected for them (``gdn``), ``full_attention``
layers to theirs (``paged``). MLPs are sparse mixture-of-experts blocks with a
gated shared expert where the config says (every released checkpoint), dense
elsewhere (:func:`kvrunner.models.qwen3.make_mlp`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from kvrunner.layers.embedding import LMHead, VocabEmbedding
from kvrunner.layers.fused import qk_norm_rope
from kvrunner.layers.linear import (
    SINGLE,
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    divide,
)
from kvrunner.layers.rmsnorm import ZeroCenteredRMSNorm
from kvrunner.layers.rotary import RotaryEmbedding
from kvrunner.models.gated_deltanet import GatedDeltaNet
from kvrunner.models.kv_scale_names import OptionalWeight, kv_scale_weights
from kvrunner.models.qwen3 import MakeLayer, Qwen3ForCausalLM, make_mlp
from kvrunner.models.qwen3_next_config import Qwen3NextConfig
from kvrunner.models.weight_names import (
    WeightTargets,
    load_weights_into,
)
from kvrunner.plugin_api.step_data import ForwardContext


class GatedAttention(nn.Module):
    """Full attention whose output is gated by ``sigmoid(gate)`` from the q projection."""

    def __init__(
        self,
        c: Qwen3NextConfig,
        impl: Any,
        rotary: RotaryEmbedding,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TPGroup,
    ) -> None:
        super().__init__()
        self.d = c.head_dim
        self.h = divide(c.num_attention_heads, tp.size, "attention heads")
        self.hkv = divide(c.num_key_value_heads, tp.size, "KV heads")
        kw = dict(dtype=dtype, device=device, tp=tp, bias=c.attention_bias)
        heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
        # q_proj rows are [query | gate] per head, so a contiguous shard is whole heads.
        self.q_proj = ColumnParallelLinear(c.hidden_size, 2 * heads * self.d, **kw)
        self.k_proj = ColumnParallelLinear(c.hidden_size, kv_heads * self.d, **kw)
        self.v_proj = ColumnParallelLinear(c.hidden_size, kv_heads * self.d, **kw)
        self.o_proj = RowParallelLinear(heads * self.d, c.hidden_size, **kw)
        self.q_norm = ZeroCenteredRMSNorm(self.d, c.rms_norm_eps, dtype=dtype, device=device)
        self.k_norm = ZeroCenteredRMSNorm(self.d, c.rms_norm_eps, dtype=dtype, device=device)
        self.rotary = rotary
        self.kv_heads, self.kv_shard = kv_heads, tp.rank
        object.__setattr__(self, "impl", impl)

    def optional_weights(self) -> dict[str, OptionalWeight]:
        """The FP8 KV-cache scales a checkpoint may carry for this layer
        (:mod:`~kvrunner.models.kv_scale_names`), this rank's KV heads' part of them."""
        return kv_scale_weights(self.impl, total_kv_heads=self.kv_heads,
                                kv_shard=self.kv_shard, local_kv_heads=self.hkv)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        t = x.shape[0]
        q, gate = self.q_proj(x).view(t, self.h, 2 * self.d).chunk(2, dim=-1)
        # q is a head-strided view (interleaved with gate); the fused kernel reads it as is.
        k = self.k_proj(x).view(t, self.hkv, self.d)
        q, k = qk_norm_rope(positions, q, k, self.q_norm, self.k_norm, self.rotary)
        out = self.impl.forward(q, k, self.v_proj(x).view(t, self.hkv, self.d), ctx)
        return self.o_proj(out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1)))


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(
        self,
        c: Qwen3NextConfig,
        kind: str,
        impl: Any,
        rotary: RotaryEmbedding,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TPGroup,
        layer_index: int = 0,
    ) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(c, impl, tp=tp, **kw)
        else:
            self.self_attn = GatedAttention(c, impl, rotary, tp=tp, **kw)
        self.input_layernorm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps, **kw)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps, **kw)
        self.mlp = make_mlp(c, layer_index, tp=tp, **kw)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        if self.kind == "linear_attention":
            x = self.linear_attn(x, ctx)
        else:
            x = self.self_attn(positions, x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, ctx), residual


class Qwen3NextModel(nn.Module):
    def __init__(
        self,
        c: Qwen3NextConfig,
        make_layer: MakeLayer,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TPGroup,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(
            c.vocab_size, c.hidden_size, dtype=dtype, device=device, tp=tp
        )
        # Partial rotary: only the leading quarter (by default) of each head rotates.
        self.rotary_emb = RotaryEmbedding(
            c.head_dim,
            max_position=c.max_position_embeddings,
            base=c.rope_theta,
            rotary_dim=int(c.head_dim * c.partial_rotary_factor),
            device=device,
        )
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(
                c, kind, make_layer(i, kind), self.rotary_emb, dtype=dtype, device=device, tp=tp,
                layer_index=i,
            )
            for i, kind in enumerate(c.layer_types)
        )
        self.norm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype, device=device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx)
        x, _ = self.norm(x, residual)
        return x


class Qwen3NextForCausalLM(Qwen3ForCausalLM):
    """The Hugging Face ``Qwen3NextForCausalLM`` architecture on a flat token batch."""

    config_class = Qwen3NextConfig

    def __init__(
        self,
        config: Qwen3NextConfig,
        make_layer: MakeLayer,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        tp: TPGroup = SINGLE,
    ) -> None:
        nn.Module.__init__(self)  # not Qwen3's: it would build Qwen3 layers
        self.config = config
        self.model = Qwen3NextModel(config, make_layer, dtype=dtype, device=device, tp=tp)
        self.lm_head = LMHead(
            config.vocab_size,
            config.hidden_size,
            dtype=dtype,
            device=device,
            tp=tp,
            tied_to=self.model.embed_tokens if config.tie_word_embeddings else None,
        )

    #: q/k/v stay separate here (q_proj also carries the output gate); gate/up fuse
    #: (the dense MLPs' and the shared experts').
    NEXT_STACKED = tuple(s for s in Qwen3ForCausalLM.STACKED if s[0] == ".gate_up_proj.")

    def expected_weight_names(self) -> set[str]:
        """Every tensor name this model loads (``conv1d.weight`` as ``conv_weight``)."""
        return set(self.weight_targets().expected)

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        require_all: bool = True,
        loaded: set[str] | None = None,
        targets: WeightTargets | None = None,
        dry_run: bool = False,
    ) -> set[str]:
        """HF names; ``conv1d.weight`` ``[C, 1, K]`` is stored as ``conv_weight`` ``[C, K]``.

        Returns the names loaded (after that renaming); ``require_all``, ``targets``
        and ``dry_run`` as for Qwen3.
        """

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.endswith(".linear_attn.conv1d.weight"):
                    yield name.replace("conv1d.weight", "conv_weight"), tensor.squeeze(1)
                else:
                    yield name, tensor

        ignore = [*self._ignored_weights(), "mtp."]
        return load_weights_into(
            self, renamed(), stacked=self.NEXT_STACKED, ignore=ignore, require_all=require_all,
            loaded=loaded, targets=targets, dry_run=dry_run,
        )

    def weight_targets(self) -> WeightTargets:
        """Where each tensor name this model loads goes (one walk of the module)."""
        return WeightTargets(self, self.NEXT_STACKED)
