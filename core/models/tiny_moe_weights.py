"""Random weights and configs for the tiny mixture-of-experts checkpoints.

Each kind is its dense sibling (``tiny_weights``) with every MLP replaced by a
sparse block, written in the released checkpoints' layout: a router
(``mlp.gate.weight``) and one tensor per expert and projection
(``mlp.experts.{e}.gate_proj.weight`` ...), plus Qwen3-Next's shared expert and
its gate.
"""

from __future__ import annotations

import torch

from kvrunner.models.tiny_weights import tiny_qwen3, tiny_qwen3_next

EXPERT_INTERMEDIATE = 32


def _normal(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * std


def sparse_mlps(
    gen: torch.Generator, config: dict, tensors: dict[str, torch.Tensor], *, experts: int,
    top_k: int, shared: int, inter: int = EXPERT_INTERMEDIATE,
) -> None:
    """Swap every layer's dense MLP tensors for a sparse block's (in place): ``experts``
    experts of ``inter``, ``top_k`` per token, a shared expert of ``shared`` (0: none)."""
    hidden = config["hidden_size"]
    config.update(
        num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=inter,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    )
    if shared:
        config["shared_expert_intermediate_size"] = shared
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp."
        for proj in ("gate_proj", "up_proj", "down_proj"):
            del tensors[p + proj + ".weight"]
        # Router std 0.3: logits spread enough that every token prefers different experts.
        tensors[p + "gate.weight"] = _normal(gen, (experts, hidden), 0.3)
        for e in range(experts):
            tensors[p + f"experts.{e}.gate_proj.weight"] = _normal(gen, (inter, hidden), 0.1)
            tensors[p + f"experts.{e}.up_proj.weight"] = _normal(gen, (inter, hidden), 0.1)
            tensors[p + f"experts.{e}.down_proj.weight"] = _normal(gen, (hidden, inter), 0.1)
        if shared:
            tensors[p + "shared_expert.gate_proj.weight"] = _normal(gen, (shared, hidden), 0.1)
            tensors[p + "shared_expert.up_proj.weight"] = _normal(gen, (shared, hidden), 0.1)
            tensors[p + "shared_expert.down_proj.weight"] = _normal(gen, (hidden, shared), 0.1)
            tensors[p + "shared_expert_gate.weight"] = _normal(gen, (1, hidden), 0.1)


def tiny_qwen3_moe(gen: torch.Generator, vocab: int, eos: int) -> tuple[dict, dict]:
    """Qwen3-MoE: tiny Qwen3's attention; 5 experts of 32, top-2, renormalised."""
    config, tensors = tiny_qwen3(gen, vocab, eos)
    config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
    sparse_mlps(gen, config, tensors, experts=5, top_k=2, shared=0)
    return config, tensors


def tiny_qwen3_next_moe(gen: torch.Generator, vocab: int, eos: int) -> tuple[dict, dict]:
    """Sparse Qwen3-Next: tiny Qwen3-Next's layers; 6 experts of 32, top-2,
    renormalised, and a shared expert of 64 behind a sigmoid gate."""
    config, tensors = tiny_qwen3_next(gen, vocab, eos)
    sparse_mlps(gen, config, tensors, experts=6, top_k=2, shared=64)
    return config, tensors
