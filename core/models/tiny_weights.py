"""Random weights and configs for the tiny checkpoints (one function per kind).

Each function takes a seeded generator, the vocabulary size and the EOS id and
returns ``(config.json dict, {HF tensor name: tensor})``.
"""

from __future__ import annotations

import torch


def _normal(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * std


def _norm_weight(gen: torch.Generator, dim: int) -> torch.Tensor:
    # Not all ones: a norm weight loaded into the wrong place must change outputs.
    return 1.0 + _normal(gen, (dim,), 0.1)


def tiny_qwen3(gen: torch.Generator, vocab: int, eos: int) -> tuple[dict, dict]:
    """Qwen3 dense: hidden 64, 2 layers, 4 query / 2 KV heads of 16, MLP 128, untied head.

    Embeddings have std 1 (so the residual stream carries the token identity) and
    every projection std 0.1 (so attention and MLP outputs are comparable to it):
    the next token then depends on context, and greedy decoding does not lock onto
    one token as it does when the embedding dominates everything.
    """
    hidden, inter, layers, heads, kv_heads, head_dim = 64, 128, 2, 4, 2, 16
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "torch_dtype": "float32",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_sliding_window": False,
        "layer_types": ["full_attention"] * layers,
        "bos_token_id": eos,
        "eos_token_id": eos,
    }
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": _normal(gen, (vocab, hidden), 1.0)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = _norm_weight(gen, hidden)
        t[p + "self_attn.q_proj.weight"] = _normal(gen, (heads * head_dim, hidden), 0.1)
        t[p + "self_attn.k_proj.weight"] = _normal(gen, (kv_heads * head_dim, hidden), 0.1)
        t[p + "self_attn.v_proj.weight"] = _normal(gen, (kv_heads * head_dim, hidden), 0.1)
        t[p + "self_attn.o_proj.weight"] = _normal(gen, (hidden, heads * head_dim), 0.1)
        t[p + "self_attn.q_norm.weight"] = _norm_weight(gen, head_dim)
        t[p + "self_attn.k_norm.weight"] = _norm_weight(gen, head_dim)
        t[p + "post_attention_layernorm.weight"] = _norm_weight(gen, hidden)
        t[p + "mlp.gate_proj.weight"] = _normal(gen, (inter, hidden), 0.1)
        t[p + "mlp.up_proj.weight"] = _normal(gen, (inter, hidden), 0.1)
        t[p + "mlp.down_proj.weight"] = _normal(gen, (hidden, inter), 0.1)
    t["model.norm.weight"] = _norm_weight(gen, hidden)
    t["lm_head.weight"] = _normal(gen, (vocab, hidden), 0.1)
    return config, t


def tiny_qwen3_next(gen: torch.Generator, vocab: int, eos: int) -> tuple[dict, dict]:
    """Qwen3-Next, dense MLPs: 4 layers (GDN, GDN, GDN, full attention), hidden 64.

    GDN: 2 key / 4 value heads of 16, conv kernel 4. Attention: 4 query / 2 KV heads
    of 16, a quarter of each head rotary, output gated. Norm weights are offsets from
    1 (Qwen3-Next's zero-centred RMSNorm), except the gated norm's.
    """
    hidden, inter, heads, kv_heads, head_dim = 64, 128, 4, 2, 16
    hk, hv, kd, vd, kernel = 2, 4, 16, 16, 4
    layer_types = ["linear_attention"] * 3 + ["full_attention"]
    config = {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "torch_dtype": "float32",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        "tie_word_embeddings": False,
        "attention_bias": False,
        "linear_num_key_heads": hk,
        "linear_num_value_heads": hv,
        "linear_key_head_dim": kd,
        "linear_value_head_dim": vd,
        "linear_conv_kernel_dim": kernel,
        "num_experts": 0,
        "mlp_only_layers": list(range(len(layer_types))),
        "decoder_sparse_step": 1,
        "bos_token_id": eos,
        "eos_token_id": eos,
    }
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": _normal(gen, (vocab, hidden), 1.0)}
    for i, kind in enumerate(layer_types):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = _normal(gen, (hidden,), 0.1)
        t[p + "post_attention_layernorm.weight"] = _normal(gen, (hidden,), 0.1)
        if kind == "linear_attention":
            a = p + "linear_attn."
            t[a + "in_proj_qkvz.weight"] = _normal(gen, (2 * hk * kd + 2 * hv * vd, hidden), 0.1)
            t[a + "in_proj_ba.weight"] = _normal(gen, (2 * hv, hidden), 0.1)
            t[a + "conv1d.weight"] = _normal(gen, (2 * hk * kd + hv * vd, 1, kernel), 0.3)
            t[a + "dt_bias"] = 1.0 + _normal(gen, (hv,), 0.1)
            t[a + "A_log"] = torch.empty(hv).uniform_(0.5, 4.0, generator=gen).log()
            t[a + "norm.weight"] = _norm_weight(gen, vd)
            t[a + "out_proj.weight"] = _normal(gen, (hidden, hv * vd), 0.1)
        else:
            a = p + "self_attn."
            t[a + "q_proj.weight"] = _normal(gen, (2 * heads * head_dim, hidden), 0.1)
            t[a + "k_proj.weight"] = _normal(gen, (kv_heads * head_dim, hidden), 0.1)
            t[a + "v_proj.weight"] = _normal(gen, (kv_heads * head_dim, hidden), 0.1)
            t[a + "o_proj.weight"] = _normal(gen, (hidden, heads * head_dim), 0.1)
            t[a + "q_norm.weight"] = _normal(gen, (head_dim,), 0.1)
            t[a + "k_norm.weight"] = _normal(gen, (head_dim,), 0.1)
        t[p + "mlp.gate_proj.weight"] = _normal(gen, (inter, hidden), 0.1)
        t[p + "mlp.up_proj.weight"] = _normal(gen, (inter, hidden), 0.1)
        t[p + "mlp.down_proj.weight"] = _normal(gen, (hidden, inter), 0.1)
    t["model.norm.weight"] = _normal(gen, (hidden,), 0.1)
    t["lm_head.weight"] = _normal(gen, (vocab, hidden), 0.1)
    return config, t
