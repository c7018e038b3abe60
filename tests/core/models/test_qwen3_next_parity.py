"""Qwen3NextForCausalLM loaded by kvrunner computes the same logits as transformers.

The layer impls here are test fixtures that stand in for the cache backends, so
the model is what is under test (weight layout and loading, projections, gates,
norms, partial rotary, MLP, LM head), not the kernels:

- full attention: causal SDPA within each sequence of the flat batch;
- linear attention: the Gated-DeltaNet core written out naively, one token at a
  time (causal depthwise conv + SiLU, q/k L2 norm, gated delta rule), following
  the contract of the ``gdn`` backend's layer (``forward(mixed_qkv, g, beta,
  conv_weight, conv_bias, ctx)`` -> ``[T, Hv, head_v_dim]``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvrunner.models.loader import load_model, parse_config
from kvrunner.models.tiny import build_tokenizer
from kvrunner.plugin_api import ForwardContext
from kvrunner.testing.model_parity import SdpaAttention, flat_logits

transformers = pytest.importorskip("transformers")

FIXTURE = "test-fixture"  # the ForwardContext key both fixtures read sequence bounds from
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
HK, HV, KD, VD, KERNEL = 2, 4, 16, 8, 4  # 2 value heads per key head: grouping matters
PROMPTS = [[5, 17, 3, 90, 41, 2, 8], [60, 1, 77], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 95]]


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)  # eps inside, as trained


def bounds_of(ctx: ForwardContext) -> list[tuple[int, int]]:
    cu: list[int] = ctx.for_backend(FIXTURE)
    return list(zip(cu[:-1], cu[1:], strict=True))


class NaiveGatedDeltaNet:
    """The GDN core per sequence from zero state, token by token, in float32."""

    def forward(self, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                ctx: ForwardContext) -> torch.Tensor:
        assert conv_bias is None and g.dtype == torch.float32
        out = torch.empty(mixed_qkv.shape[0], HV, VD, dtype=mixed_qkv.dtype)
        w = conv_weight.float()
        for start, end in bounds_of(ctx):
            x = mixed_qkv[start:end].float()
            # Causal conv: output t sees inputs t-K+1 .. t (zeros before the start).
            padded = torch.cat([torch.zeros(KERNEL - 1, x.shape[1]), x])
            conv = torch.stack([(padded[t : t + KERNEL].T * w).sum(-1) for t in range(len(x))])
            conv = F.silu(conv)
            q, k, v = conv.split([HK * KD, HK * KD, HV * VD], dim=-1)
            q, k = (l2norm(t.view(-1, HK, KD)) for t in (q, k))
            v = v.view(-1, HV, VD)
            state = torch.zeros(HV, KD, VD)
            for t in range(len(x)):
                for h in range(HV):
                    kh, qh = k[t, h // (HV // HK)], q[t, h // (HV // HK)] * KD**-0.5
                    state[h] *= g[start + t, h].exp()
                    delta = beta[start + t, h].float() * (v[t, h] - kh @ state[h])
                    state[h] += torch.outer(kh, delta)
                    out[start + t, h] = (qh @ state[h]).to(out.dtype)
        return out


def make_fixture_layer(layer_index: int, layer_type: str) -> object:
    return NaiveGatedDeltaNet() if layer_type == "linear_attention" else SdpaAttention(FIXTURE)


def write_hf_checkpoint(path: Path, *, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random transformers Qwen3-Next (dense MLPs) saved as safetensors, with every
    weight perturbed away from its init so one loaded wrongly changes the logits."""
    torch.manual_seed(seed)
    kwargs = dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=HK, linear_num_value_heads=HV, linear_key_head_dim=KD,
        linear_value_head_dim=VD, linear_conv_kernel_dim=KERNEL, num_experts=0,
        max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                         "partial_rotary_factor": 0.25},
    )
    config = transformers.Qwen3NextConfig(**(kwargs | overrides))
    config._attn_implementation = "eager"
    model = transformers.Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # decays from slow to fast across heads
                p.copy_(torch.empty_like(p).uniform_(0.3, 3.0).log())
            elif name.endswith("dt_bias") or "norm" in name:
                # zero-centred norms (1 + w), the gated norm (w) and dt_bias alike
                p.add_(0.3 * torch.randn_like(p))
            elif "embed" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    build_tokenizer().save(str(path / "tokenizer.json"))
    return model


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()


def ours_logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    return flat_logits(model, prompts, FIXTURE)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_word_embeddings": True, "attention_bias": True}],
    ids=["untied", "tied+attention_bias"],
)
def test_logits_match_transformers(tmp_path: Path, overrides: dict) -> None:
    hf = write_hf_checkpoint(tmp_path, **overrides)
    layer0 = hf.model.layers[0].linear_attn
    assert (layer0.dt_bias != 1).all() and layer0.norm.weight.std() > 0.1  # not at their init
    model, _, config = load_model(tmp_path, dtype=torch.float32, device="cpu",
                                  make_layer=make_fixture_layer)
    assert config.layer_types == tuple(LAYER_TYPES)
    assert model.model.rotary_emb.rotary_dim == 4  # a quarter of head_dim 16
    for prompt, ours in zip(PROMPTS, ours_logits(model, PROMPTS), strict=True):
        ref = hf_logits(hf, prompt)
        assert ours.dtype == torch.float32 and ours.shape == ref.shape
        scale = ref.abs().max()
        assert scale > 1.0  # logits large enough that a wrong weight would show
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * scale)


def test_batch_composition_does_not_change_a_sequence(tmp_path: Path) -> None:
    write_hf_checkpoint(tmp_path)
    model, _, _ = load_model(tmp_path, dtype="float32", device="cpu",
                             make_layer=make_fixture_layer)
    alone = ours_logits(model, [PROMPTS[1]])[0]
    batched = ours_logits(model, PROMPTS)[1]
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)


def test_bfloat16_load_stays_close_to_float32(tmp_path: Path) -> None:
    hf = write_hf_checkpoint(tmp_path)
    model, _, _ = load_model(tmp_path, dtype=torch.bfloat16, device="cpu",
                             make_layer=make_fixture_layer)
    assert model.model.layers[0].linear_attn.in_proj_qkvz.weight.dtype == torch.bfloat16
    ours = ours_logits(model, [PROMPTS[0]])[0]
    ref = hf_logits(hf, PROMPTS[0])
    assert ours.dtype == torch.float32
    # bf16 keeps ~3 significant digits; a wiring error would be off by O(1).
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()


# -- config.json parsing ----------------------------------------------------------------


def hf_config_dict(**overrides) -> dict:
    return transformers.Qwen3NextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=HK,
        linear_num_value_heads=HV, linear_key_head_dim=KD, linear_value_head_dim=VD,
        **overrides,
    ).to_dict() | {"architectures": ["Qwen3NextForCausalLM"]}


def test_released_checkpoint_style_config_parses_as_transformers_reads_it() -> None:
    """Released Qwen3-Next config.json files carry ``full_attention_interval`` instead of
    ``layer_types`` and a flat ``partial_rotary_factor`` (or none: 0.25 by default)."""
    d = hf_config_dict(num_experts=0)
    expected_types = tuple(d["layer_types"])
    assert expected_types == ("linear_attention",) * 3 + ("full_attention",)
    for key in ("layer_types", "rope_parameters"):
        del d[key]
    d |= {"full_attention_interval": 4, "rope_theta": 5000.0}
    _, config = parse_config(d)
    assert config.layer_types == expected_types
    assert config.partial_rotary_factor == 0.25 and config.rope_theta == 5000.0
    _, config = parse_config(d | {"partial_rotary_factor": 0.5, "full_attention_interval": 2})
    assert config.partial_rotary_factor == 0.5
    assert config.layer_types == ("linear_attention", "full_attention") * 2


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers() -> None:
    _, config = parse_config(hf_config_dict(num_experts=8, decoder_sparse_step=2,
                                            mlp_only_layers=[], num_experts_per_tok=3,
                                            moe_intermediate_size=16,
                                            shared_expert_intermediate_size=24))
    assert config.moe.sparse_layers == (1, 3)
    assert (config.moe.num_experts, config.moe.top_k) == (8, 3)
    assert config.moe.intermediate_size == 16 and config.moe.shared_expert_intermediate_size == 24
    # mlp_only_layers covering every sparse layer makes it dense; null means "none".
    _, config = parse_config(hf_config_dict(num_experts=8, mlp_only_layers=[0, 1, 2, 3]))
    assert config.moe is None
    _, config = parse_config(
        hf_config_dict(num_experts=8, num_experts_per_tok=2) | {"mlp_only_layers": None}
    )
    assert config.moe.sparse_layers == (0, 1, 2, 3)
