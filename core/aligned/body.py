"""The aligned forward of a transformers Qwen3 / Qwen3-MoE body: the engine's ops in
the engine's order (``models/qwen3.py``) on the transformers model's own weights.

Per layer, as the engine runs it: the residual add fused into the input norm;
q, k and v from one product over the stacked weights; per-head norms and rotary in
one call; fixed-order attention; the output projection; the residual add fused into
the post-attention norm; gate and up from one product, the activation, the down
projection (or the sparse block). The final norm takes the last residual add, and
the padded batch is computed as the engine's flat batch of its real tokens
(``token_batch.py``). Weights are concatenated anew each forward, so the gradient
reaches the transformers parameters through the concatenation.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvrunner.aligned.activation import aligned_silu_mul
from kvrunner.aligned.attention import aligned_attention, attention_reference
from kvrunner.aligned.context import aligned_context
from kvrunner.aligned.linear import aligned_linear
from kvrunner.aligned.moe import aligned_moe
from kvrunner.aligned.norm import aligned_rmsnorm
from kvrunner.aligned.plan import AlignedPlan
from kvrunner.aligned.rotary import aligned_qk_norm_rope
from kvrunner.aligned.rules import AlignmentError
from kvrunner.aligned.token_batch import TokenBatch, token_batch
from kvrunner.models.loader import rope_theta_of


def _cat(*tensors: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensors[0] is None else torch.cat(tensors)


class AlignedBody:
    """One forward of the body of ``causal_lm`` under ``plan`` (see the module doc)."""

    def __init__(self, causal_lm: nn.Module, plan: AlignedPlan) -> None:
        self.lm, self.body, self.plan = causal_lm, causal_lm.model, plan
        config = causal_lm.config
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        self.rope_base = rope_theta_of(config.to_dict())
        self.max_position = config.max_position_embeddings
        self.hf = sys.modules[type(causal_lm).__module__]  # apply_rotary_pos_emb, ...

    # -- the ops, each on the engine's kernel or (transformers_ops) transformers' own --

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.plan.aligned("linear"):
            return aligned_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def norm(self, module: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The transformers norm ``module``'s function of ``x``; with ``residual``,
        ``(norm(x + residual), x + residual)``."""
        if self.plan.aligned("norm"):
            return aligned_rmsnorm(x, module.weight, module.variance_epsilon, residual)
        if residual is None:
            return module(x)
        total = residual + x
        return module(total), total

    def attention(self, attn: nn.Module, x: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
        """The attention block ``attn`` (a transformers ``Qwen3Attention``) on ``x``."""
        hq, hk = attn.config.num_attention_heads, attn.config.num_key_value_heads
        d = self.head_dim
        qkv = self.linear(x, _cat(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight),
                          _cat(attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias))
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        q, k, v = q.view(-1, hq, d), k.view(-1, hk, d), v.view(-1, hk, d)
        if self.plan.aligned("rotary"):
            rotary = self.plan.rotary(d, self.max_position, self.rope_base, x.device)
            q, k = aligned_qk_norm_rope(batch.positions, q, k, attn.q_norm.weight,
                                        attn.k_norm.weight, attn.q_norm.variance_epsilon, rotary)
        else:
            cos, sin = self.body.rotary_emb(x, batch.positions[None])
            q, k = self.hf.apply_rotary_pos_emb(attn.q_norm(q), attn.k_norm(k), cos[0], sin[0])
        if self.plan.aligned("attention"):
            out = aligned_attention(q, k, v, batch.lengths, attn.scaling)
        else:  # transformers' SDPA in the model dtype, one sequence at a time
            out = attention_reference(q, k, v, batch.lengths, attn.scaling, dtype=q.dtype)
        return self.linear(out.reshape(-1, hq * d), attn.o_proj.weight, attn.o_proj.bias)

    def mlp(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A dense SwiGLU MLP or a sparse block (it has ``experts``) on ``x``."""
        if hasattr(mlp, "experts"):
            if not self.plan.aligned("moe"):
                return mlp(x[None])[0]
            return aligned_moe(x, mlp.gate.weight, mlp.experts.gate_up_proj,
                               mlp.experts.down_proj, top_k=mlp.gate.top_k,
                               renormalize=bool(mlp.gate.norm_topk_prob),
                               router_dtype=torch.float32 if self.plan.fp32_router_logits
                               else None)
        gate_up = self.linear(x, _cat(mlp.gate_proj.weight, mlp.up_proj.weight))
        if self.plan.aligned("activation"):
            act = aligned_silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = mlp.act_fn(gate) * up
        return self.linear(act, mlp.down_proj.weight)

    # -- the body --

    def hidden(self, batch: TokenBatch) -> torch.Tensor:
        """``[T, hidden]``: the final norm's output of every real token."""
        embed = self.body.embed_tokens
        x = F.embedding(batch.input_ids, embed.weight, embed.padding_idx)
        residual = None
        for layer in self.body.layers:
            if residual is None:
                residual, x = x, self.norm(layer.input_layernorm, x)
            else:
                x, residual = self.norm(layer.input_layernorm, x, residual)
            x = self.attention(layer.self_attn, x, batch)
            x, residual = self.norm(layer.post_attention_layernorm, x, residual)
            x = self.mlp(layer.mlp, x)
        x, _ = self.norm(self.body.norm, x, residual)
        return x

    def __call__(self, input_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """The transformers body's ``forward`` (``model.model(...)``), aligned."""
        from transformers.modeling_outputs import BaseModelOutputWithPast, MoeModelOutputWithPast

        _refuse_extras(input_ids, kwargs)
        batch = token_batch(input_ids, attention_mask, position_ids)
        with aligned_context(self.plan, input_ids.device):
            hidden = batch.unflatten(self.hidden(batch))
        if "Moe" in type(self.lm).__name__:
            return MoeModelOutputWithPast(last_hidden_state=hidden)
        return BaseModelOutputWithPast(last_hidden_state=hidden)


def _refuse_extras(input_ids: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
    if input_ids is None or kwargs.get("inputs_embeds") is not None:
        raise AlignmentError("aligned forward: pass input_ids (inputs_embeds is not supported)")
    for name in ("cache", "past_key_values"):
        if kwargs.get(name) is not None:
            raise AlignmentError(f"aligned forward: {name} is not supported (the aligned "
                                 "forward scores whole sequences, with no KV cache)")
    for name in ("use_cache", "output_attentions", "output_hidden_states",
                 "output_router_logits"):
        if kwargs.get(name):
            raise AlignmentError(f"aligned forward: {name}=True is not supported")
