"""Qwen3ForCausalLM loaded by kvrunner computes the same logits as transformers.

The attention impl is ``kvrunner.testing``'s cache-free SDPA over each sequence's own
tokens, with the sequence boundaries passed through the ForwardContext. It stands
in for a cache backend so the model layers (projections, norms, rotary, MLP, LM
head, weight loading) are what is under test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from kvrunner.models.loader import load_model
from kvrunner.models.tiny import build_tokenizer
from kvrunner.plugin_api import ForwardContext
from kvrunner.testing.model_parity import SdpaAttention, flat_logits

BACKEND = "test-sdpa"


def make_sdpa_layer(layer_index: int, layer_type: str) -> SdpaAttention:
    assert layer_type == "full_attention"
    return SdpaAttention(BACKEND)


def write_hf_checkpoint(
    path: Path, *, tied: bool, seed: int = 0, **overrides
) -> transformers.Qwen3ForCausalLM:
    """A random transformers Qwen3 saved in safetensors; every weight is perturbed so a
    weight loaded into the wrong place (or not at all) changes the logits."""
    torch.manual_seed(seed)
    kwargs = dict(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=1000.0, tie_word_embeddings=tied, eos_token_id=3,
    )
    kwargs.update(overrides)
    config = transformers.Qwen3Config(**kwargs)
    config._attn_implementation = "eager"
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "embed" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    build_tokenizer().save(str(path / "tokenizer.json"))
    return model


def hf_logits(model: transformers.Qwen3ForCausalLM, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def ours_logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    return flat_logits(model, prompts, BACKEND)


PROMPTS = [[5, 17, 3, 90, 41, 2, 8], [60, 1, 77], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 95]]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_match_transformers(tmp_path: Path, tied: bool) -> None:
    hf = write_hf_checkpoint(tmp_path, tied=tied)
    model, _, config = load_model(tmp_path, dtype=torch.float32, device="cpu",
                                  make_layer=make_sdpa_layer)
    assert config.tie_word_embeddings is tied
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
    for prompt, ours in zip(PROMPTS, ours_logits(model, PROMPTS), strict=True):
        ref = hf_logits(hf, prompt)
        assert ours.dtype == torch.float32 and ours.shape == ref.shape
        scale = ref.abs().max()
        assert scale > 1.0  # logits large enough that a wrong weight would show
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * scale)


def test_batch_composition_does_not_change_a_sequence(tmp_path: Path) -> None:
    write_hf_checkpoint(tmp_path, tied=False)
    model, _, _ = load_model(tmp_path, dtype="float32", device="cpu", make_layer=make_sdpa_layer)
    alone = ours_logits(model, [PROMPTS[1]])[0]
    batched = ours_logits(model, PROMPTS)[1]
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)


def test_rope_theta_and_attention_bias_are_honoured(tmp_path: Path) -> None:
    hf = write_hf_checkpoint(tmp_path, tied=False, rope_theta=50.0, attention_bias=True)
    model, _, config = load_model(tmp_path, dtype="auto", device="cpu", make_layer=make_sdpa_layer)
    assert config.rope_theta == 50.0 and config.attention_bias
    ref = hf_logits(hf, PROMPTS[2])
    ours = ours_logits(model, [PROMPTS[2]])[0]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max())


def test_bfloat16_load_stays_close_to_float32(tmp_path: Path) -> None:
    hf = write_hf_checkpoint(tmp_path, tied=True)
    model, _, _ = load_model(tmp_path, dtype=torch.bfloat16, device="cpu",
                             make_layer=make_sdpa_layer)
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    ours = ours_logits(model, [PROMPTS[0]])[0]
    ref = hf_logits(hf, PROMPTS[0])
    assert ours.dtype == torch.float32
    # bf16 keeps ~3 significant digits; a wiring error would be off by O(1).
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_match_transformers_on_cuda(tmp_path: Path, dtype: torch.dtype) -> None:
    hf = write_hf_checkpoint(tmp_path, tied=False)
    model, _, _ = load_model(tmp_path, dtype=dtype, device="cuda", make_layer=make_sdpa_layer)
    assert model.lm_head.weight.device.type == "cuda"
    prompts = PROMPTS
    ids = torch.tensor([t for p in prompts for t in p], device="cuda")
    positions = torch.cat([torch.arange(len(p)) for p in prompts]).cuda()
    bounds = [0]
    for p in prompts:
        bounds.append(bounds[-1] + len(p))
    ctx = ForwardContext(metadata={BACKEND: bounds})
    with torch.no_grad():
        logits = model.compute_logits(model(ids, positions, ctx))
    for i, prompt in enumerate(prompts):
        ref = hf_logits(hf, prompt)
        ours = logits[bounds[i] : bounds[i + 1]].cpu()
        assert ours.dtype == torch.float32
        limit = 1e-4 if dtype == torch.float32 else 0.05
        assert (ours - ref).abs().max() <= limit * ref.abs().max()
