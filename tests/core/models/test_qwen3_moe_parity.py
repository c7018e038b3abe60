"""Qwen3MoeForCausalLM loaded by kvrunner computes the same logits as transformers.

Attention is the cache-free SDPA fixture, so what is under test is the model:
routing (softmax, top-k, ``norm_topk_prob``), which layers are sparse
(``decoder_sparse_step``, ``mlp_only_layers``), the per-expert weights fused at load
into the stacked layout, and the experts' computation.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvrunner.layers.moe import SparseMoeBlock
from kvrunner.models.loader import load_model, parse_config
from kvrunner.models.qwen3 import Qwen3MLP
from kvrunner.testing.model_parity import SdpaAttention, flat_logits
from kvrunner.testing.moe_checkpoints import save_hf_qwen3_moe

transformers = pytest.importorskip("transformers")

KEY = "test-sdpa"
PROMPTS = [[5, 17, 3, 90, 41, 2, 8], [60, 1, 77], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 95]]


def make_sdpa_layer(layer_index: int, layer_type: str) -> SdpaAttention:
    return SdpaAttention(KEY)


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()


CASES = {
    "5-experts-top2-renorm": dict(num_experts=5, num_experts_per_tok=2, norm_topk_prob=True),
    "7-experts-top3-raw": dict(num_experts=7, num_experts_per_tok=3, norm_topk_prob=False),
    "top-k-equals-experts": dict(num_experts=3, num_experts_per_tok=3, norm_topk_prob=False),
    "top-1": dict(num_experts=5, num_experts_per_tok=1, norm_topk_prob=False),
    "dense-layer-0": dict(num_experts=5, num_experts_per_tok=2, mlp_only_layers=[0]),
    "sparse-step-2": dict(num_experts=5, num_experts_per_tok=2, decoder_sparse_step=2,
                          num_hidden_layers=4),
}


@pytest.mark.parametrize("overrides", list(CASES.values()), ids=list(CASES))
def test_logits_match_transformers(tmp_path: Path, overrides: dict) -> None:
    hf = save_hf_qwen3_moe(tmp_path, seed=1, **overrides)
    model, _, config = load_model(tmp_path, dtype=torch.float32, device="cpu",
                                  make_layer=make_sdpa_layer)
    hf_sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert list(config.moe.sparse_layers) == hf_sparse
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer.mlp, SparseMoeBlock if i in hf_sparse else Qwen3MLP)
    for prompt, ours in zip(PROMPTS, flat_logits(model, PROMPTS, KEY), strict=True):
        ref = hf_logits(hf, prompt)
        scale = ref.abs().max()
        assert scale > 1.0  # logits large enough that a wrong weight would show
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * scale)


def test_experts_fuse_at_load_into_the_stacked_layout(tmp_path: Path) -> None:
    hf = save_hf_qwen3_moe(tmp_path, seed=2)
    model, _, _ = load_model(tmp_path, dtype=torch.float32, device="cpu",
                             make_layer=make_sdpa_layer)
    ours = model.model.layers[1].mlp.experts
    theirs = hf.model.layers[1].mlp.experts  # transformers stacks [E, 2I, H] / [E, H, I] too
    assert ours.w13.shape == theirs.gate_up_proj.shape
    torch.testing.assert_close(ours.w13, theirs.gate_up_proj, rtol=0, atol=0)
    torch.testing.assert_close(ours.w2, theirs.down_proj, rtol=0, atol=0)
    names = model.expected_weight_names()
    assert "model.layers.1.mlp.experts.4.down_proj.weight" in names
    assert "model.layers.1.mlp.gate.weight" in names
    assert not any("w13" in n or "w2" in n for n in names)


def test_bfloat16_load_stays_close_to_float32(tmp_path: Path) -> None:
    hf = save_hf_qwen3_moe(tmp_path, seed=3)
    model, _, _ = load_model(tmp_path, dtype=torch.bfloat16, device="cpu",
                             make_layer=make_sdpa_layer)
    assert model.model.layers[0].mlp.experts.w13.dtype == torch.bfloat16
    ours = torch.cat(flat_logits(model, PROMPTS, KEY))
    ref = torch.cat([hf_logits(hf, p) for p in PROMPTS])
    # bf16 keeps ~3 significant digits, and a near-tie in routing may flip for a few
    # tokens (then their row differs as two different experts do); a wiring error
    # would put the typical row off by O(1).
    row_err = (ours - ref).abs().amax(dim=-1) / ref.abs().max()
    assert row_err.median() < 0.03


def released_config(**overrides) -> dict:
    """Qwen3-30B-A3B's config.json fields (shapes cut down), as released."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 96, "rope_theta": 1000000.0, "hidden_act": "silu",
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
        "output_router_logits": False, "router_aux_loss_coef": 0.001,
    } | overrides


def test_released_config_names_parse() -> None:
    _, config = parse_config(released_config())
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (8, 2, 32)
    assert moe.norm_topk_prob and moe.sparse_layers == (0, 1, 2)
    assert moe.shared_expert_intermediate_size == 0
    # transformers 5 writes num_local_experts instead of num_experts
    d = released_config()
    d["num_local_experts"] = d.pop("num_experts")
    assert parse_config(d)[1].moe == moe
    assert parse_config(released_config(mlp_only_layers=[0, 2]))[1].moe.sparse_layers == (1,)


def test_impossible_routing_and_splits_are_refused() -> None:
    with pytest.raises(ValueError, match="num_experts_per_tok=9 must be between 1 and"):
        parse_config(released_config(num_experts_per_tok=9))
    _, config = parse_config(released_config(moe_intermediate_size=30))
    with pytest.raises(ValueError, match="moe_intermediate_size: 30 is not divisible"):
        config.model_spec(4)
