"""Qwen3 dense decoder (``Qwen3ForCausalLM``), computing on a flat batch of tokens.

Sequences are concatenated into one ``[T]`` token row with their positions; the
attention backend (``make_layer``) knows from the step's metadata where each
sequence starts and where its cache lives. Module names mirror the Hugging Face
checkpoint names, except that q/k/v and gate/up are fused into one matmul each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import torch
from torch import nn

from kvrunner.layers.embedding import LMHead, VocabEmbedding
from kvrunner.layers.fused import qk_norm_rope
from kvrunner.layers.linear import (
    SINGLE,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
    divide,
    kv_replicas,
)
from kvrunner.layers.moe import SparseMoeBlock
from kvrunner.layers.rmsnorm import RMSNorm
from kvrunner.layers.rotary import RotaryEmbedding
from kvrunner.models.kv_scale_names import OptionalWeight, kv_scale_weights
from kvrunner.models.loader import rope_theta_of
from kvrunner.models.moe_config import MoeConfig
from kvrunner.models.weight_names import (
    WeightTargets,
    load_weights_into,
)
from kvrunner.plugin_api.layers import FullAttentionImpl
from kvrunner.plugin_api.step_data import ForwardContext, ModelSpec

MakeLayer = Callable[[int, str], FullAttentionImpl]


def _eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


@attrs.frozen(kw_only=True)
class Qwen3Config:
    """The fields of a Qwen3 ``config.json`` this implementation uses."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_id: tuple[int, ...] = attrs.field(default=(), converter=_eos_tuple)
    layer_types: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    dtype: str | None = None  # the checkpoint's dtype name, for dtype="auto"
    #: mixture-of-experts layers (None: every MLP dense)
    moe: MoeConfig | None = None

    def __attrs_post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_hidden_layers)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"Qwen3Config: {len(self.layer_types)} layer_types for "
                f"{self.num_hidden_layers} layers"
            )
        unsupported = sorted(set(self.layer_types) - {"full_attention"})
        if unsupported:
            raise ValueError(f"Qwen3Config: unsupported layer types {unsupported}")
        divide(self.num_attention_heads, self.num_key_value_heads, "num_attention_heads",
               by="num_key_value_heads")

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> Qwen3Config:
        """Parse a Hugging Face ``config.json`` dict (unknown keys are ignored)."""
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Qwen3Config: hidden_act {d['hidden_act']!r} is not supported")
        if d.get("use_sliding_window"):
            raise ValueError("Qwen3Config: sliding-window attention is not supported")
        heads = d["num_attention_heads"]
        return cls(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            vocab_size=d["vocab_size"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta_of(d),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", False),
            eos_token_id=d.get("eos_token_id"),
            layer_types=d.get("layer_types") or (),
            dtype=d.get("dtype") or d.get("torch_dtype"),
        )

    def model_spec(self, tp_size: int = 1) -> ModelSpec:
        """Shapes per tensor-parallel rank (KV heads are replicated below one per rank)."""
        if self.moe is not None:
            self.moe.check_tp(tp_size)
        kv = self.num_key_value_heads
        if kv >= tp_size:
            kv = divide(kv, tp_size, "KV heads")
        else:
            kv_replicas(kv, tp_size)
            kv = 1
        return ModelSpec(
            num_layers=self.num_hidden_layers,
            layer_types=self.layer_types,
            num_heads=divide(self.num_attention_heads, tp_size, "query heads"),
            num_kv_heads=kv,
            head_dim=self.head_dim,
        )


class Qwen3Attention(nn.Module):
    """qkv -> per-head RMSNorm on q and k -> rotary -> backend attention -> o_proj."""

    def __init__(self, c: Qwen3Config, impl: FullAttentionImpl, rotary: RotaryEmbedding,
                 *, dtype: torch.dtype, device: torch.device | str, tp: TPGroup) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device, tp=tp)
        self.qkv_proj = QKVParallelLinear(c.hidden_size, c.head_dim, c.num_attention_heads,
                                          c.num_key_value_heads, bias=c.attention_bias, **kw)
        self.o_proj = RowParallelLinear(c.num_attention_heads * c.head_dim, c.hidden_size,
                                        bias=c.attention_bias, **kw)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype=dtype, device=device)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype=dtype, device=device)
        self.rotary = rotary
        # Not a registered submodule: the backend owns its state, and its tensors
        # must not show up as model weights to load.
        object.__setattr__(self, "impl", impl)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        p = self.qkv_proj
        q, k, v = p.split(p(x))
        # q and k stay strided views of the qkv output: the fused kernel reads them as is.
        q, k = qk_norm_rope(positions, q.view(-1, p.num_heads, p.head_dim),
                            k.view(-1, p.num_kv_heads, p.head_dim),
                            self.q_norm, self.k_norm, self.rotary)
        out = self.impl.forward(q, k, v.view(-1, p.num_kv_heads, p.head_dim), ctx)
        return self.o_proj(out.reshape(-1, p.q_size))

    def optional_weights(self) -> dict[str, OptionalWeight]:
        """The FP8 KV-cache scales a checkpoint may carry for this layer
        (:mod:`~kvrunner.models.kv_scale_names`), this rank's KV heads' part of them."""
        p = self.qkv_proj
        return kv_scale_weights(self.impl, total_kv_heads=p.total_num_kv_heads,
                                kv_shard=p.kv_shard, local_kv_heads=p.num_kv_heads)


class Qwen3MLP(nn.Module):
    def __init__(self, c: Qwen3Config, *, dtype: torch.dtype, device: torch.device | str,
                 tp: TPGroup) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device, tp=tp)
        self.gate_up_proj = MergedColumnParallelLinear(
            c.hidden_size, [c.intermediate_size] * 2, **kw
        )
        self.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, **kw)

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        """``[T, H]`` -> ``[T, H]``; ``ctx`` is taken as a sparse block takes it, and unused."""
        # SwiGLU; one row fuses the activation into the down projection's launch
        return self.down_proj.forward_silu_mul(self.gate_up_proj(x))


def make_mlp(c: Qwen3Config, layer_index: int, *, dtype: torch.dtype,
             device: torch.device | str, tp: TPGroup) -> nn.Module:
    """Layer ``layer_index``'s MLP: a sparse block where ``c.moe`` says, else dense."""
    moe = c.moe
    if moe is None or layer_index not in moe.sparse_layers:
        return Qwen3MLP(c, dtype=dtype, device=device, tp=tp)
    return SparseMoeBlock(
        hidden_size=c.hidden_size, num_experts=moe.num_experts, top_k=moe.top_k,
        intermediate_size=moe.intermediate_size, renormalize=moe.norm_topk_prob,
        shared_intermediate_size=moe.shared_expert_intermediate_size,
        dtype=dtype, device=device, tp=tp,
    )


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm block; the residual add is fused into the following norm."""

    def __init__(self, c: Qwen3Config, impl: FullAttentionImpl, rotary: RotaryEmbedding,
                 *, dtype: torch.dtype, device: torch.device | str, tp: TPGroup,
                 layer_index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = Qwen3Attention(c, impl, rotary, dtype=dtype, device=device, tp=tp)
        self.post_attention_layernorm = RMSNorm(
            c.hidden_size, c.rms_norm_eps, dtype=dtype, device=device
        )
        self.mlp = make_mlp(c, layer_index, dtype=dtype, device=device, tp=tp)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, ctx), residual


class Qwen3Model(nn.Module):
    def __init__(self, c: Qwen3Config, make_layer: MakeLayer, *, dtype: torch.dtype,
                 device: torch.device | str, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(c.vocab_size, c.hidden_size, dtype=dtype,
                                           device=device, tp=tp)
        self.rotary_emb = RotaryEmbedding(c.head_dim, max_position=c.max_position_embeddings,
                                          base=c.rope_theta, device=device)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(c, make_layer(i, kind), self.rotary_emb, dtype=dtype,
                              device=device, tp=tp, layer_index=i)
            for i, kind in enumerate(c.layer_types)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx)
        x, _ = self.norm(x, residual)
        return x


class Qwen3ForCausalLM(nn.Module):
    """The Hugging Face ``Qwen3ForCausalLM`` architecture on a flat token batch."""

    config_class = Qwen3Config

    #: fused parameter fragment -> (checkpoint fragment, shard id), for load_weights
    STACKED = (
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", 0),
        (".gate_up_proj.", ".up_proj.", 1),
    )

    def __init__(self, config: Qwen3Config, make_layer: MakeLayer, dtype: torch.dtype,
                 device: torch.device | str, *, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config, make_layer, dtype=dtype, device=device, tp=tp)
        self.lm_head = LMHead(
            config.vocab_size, config.hidden_size, dtype=dtype, device=device, tp=tp,
            tied_to=self.model.embed_tokens if config.tie_word_embeddings else None,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """``input_ids``, ``positions``: ``[T]`` long -> final hidden states ``[T, hidden]``."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor, *, widen: bool = True) -> torch.Tensor:
        """``[N, hidden]`` (usually each sequence's last row) -> ``[N, vocab]`` float32;
        in the model dtype with ``widen=False`` (the sampler widens what it reads)."""
        return self.lm_head(hidden, widen=widen)

    def _ignored_weights(self) -> list[str]:
        # Tied checkpoints may still carry lm_head.weight; it is the embedding's copy.
        # Old checkpoints store the (recomputed) rotary inverse frequencies.
        ignore = ["rotary_emb.inv_freq"]
        if self.config.tie_word_embeddings:
            ignore.append("lm_head.weight")
        return ignore

    def expected_weight_names(self) -> set[str]:
        """Every Hugging Face tensor name this model loads."""
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
        """Load Hugging Face-named tensors; returns the names loaded.

        ``require_all``: a whole checkpoint (raises naming every missing/unexpected
        tensor); ``False`` for a partial update (an unknown name raises at once).
        ``targets``: :meth:`weight_targets`, built once for the parts of one update.
        ``dry_run``: judge every name and shape, copy nothing (see
        :func:`~kvrunner.models.weight_names.load_weights_into`).
        """
        return load_weights_into(
            self, weights, stacked=self.STACKED, ignore=self._ignored_weights(),
            require_all=require_all, loaded=loaded, targets=targets, dry_run=dry_run,
        )

    def weight_targets(self) -> WeightTargets:
        """Where each tensor name this model loads goes (one walk of the module)."""
        return WeightTargets(self, self.STACKED)
