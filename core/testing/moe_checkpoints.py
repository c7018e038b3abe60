"""Random transformers mixture-of-experts checkpoints for parity tests.

Each writer builds the transformers model from a small config, widens its random
weights (transformers initialises with a small std and trivial norms, which makes
greedy decoding repeat one token and routing nearly uniform) and saves it with
``save_pretrained``, so the files carry exactly the names and layout transformers
writes: per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: Qwen3-MoE: 5 experts (odd), top-2, renormalised, every layer sparse
QWEN3_MOE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_experts=5, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=256, tie_word_embeddings=False, rope_theta=10000.0,
)  # fmt: skip

#: Qwen3-Next: GDN and gated attention, sparse blocks with a shared expert
QWEN3_NEXT_MOE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, num_experts=5, num_experts_per_tok=2, norm_topk_prob=True,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, decoder_sparse_step=1,
    mlp_only_layers=[], max_position_embeddings=256, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)  # fmt: skip


def _widen(model: torch.nn.Module, *, zero_centred_norms: bool) -> None:
    """Every weight away from its init, so one loaded wrongly changes the outputs."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # decays from slow to fast across heads
                p.copy_(torch.empty_like(p).uniform_(0.5, 4.0).log())
            elif "embed" in name and zero_centred_norms:
                p.normal_(0.0, 1.0)
            elif p.dim() > 1:  # (Qwen3's embedding too: at std 1 it would drown the layers)
                p.normal_(0.0, 0.2)
            elif "norm" in name and not zero_centred_norms:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))  # Qwen3's norms scale by w
            else:  # dt_bias, zero-centred norms (1 + w), the gated norm
                p.add_(0.3 * torch.randn_like(p))


def save_hf_qwen3_moe(path: str | Path, *, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random transformers ``Qwen3MoeForCausalLM`` (:data:`QWEN3_MOE` + ``overrides``)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(**(QWEN3_MOE | overrides))
    model = transformers.Qwen3MoeForCausalLM(config)
    _widen(model.eval(), zero_centred_norms=False)
    model.save_pretrained(path, safe_serialization=True)
    return model


def save_hf_qwen3_next_moe(
    path: str | Path, *, seed: int = 0, **overrides: Any
) -> torch.nn.Module:
    """A random transformers sparse ``Qwen3NextForCausalLM`` (:data:`QWEN3_NEXT_MOE`
    updated by ``overrides``)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3NextConfig(**(QWEN3_NEXT_MOE | overrides))
    model = transformers.Qwen3NextForCausalLM(config)
    _widen(model.eval(), zero_centred_norms=True)
    model.save_pretrained(path, safe_serialization=True)
    return model
