"""Whole layers on the Triton path compute what they compute on the torch path.

A tiny Qwen3 (the built-in ``tiny_qwen3`` weights) end to end, and a Qwen3-Next
full-attention decoder layer (zero-centred norms, q interleaved with its output
gate, partial rotary), run with ``[kernels] triton_on_cpu`` under the interpreter
against the same modules' torch code. Attention itself is a causal-SDPA fixture:
the cache backends are not under test here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fused_testing import TORCH_MATH_OPS, ULP, triton_path
from torch.profiler import profile

from kvrunner.layers.linear import SINGLE
from kvrunner.layers.rotary import RotaryEmbedding
from kvrunner.models.qwen3 import Qwen3Config, Qwen3DecoderLayer, Qwen3ForCausalLM
from kvrunner.models.qwen3_next import Qwen3NextDecoderLayer
from kvrunner.models.qwen3_next_config import Qwen3NextConfig
from kvrunner.models.tiny_weights import tiny_qwen3, tiny_qwen3_next
from kvrunner.plugin_api import ForwardContext

KEY = "fused-test"  # ForwardContext key the fixture reads sequence bounds from
PROMPTS = [[5, 17, 3, 90, 41, 2, 8], [60, 1, 77]]


class CausalSdpa:
    """Causal attention within each sequence of a flat batch; no cache."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        bounds: list[int] = ctx.for_backend(KEY)
        groups = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
            ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
            out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(
                0, 1
            )
        return out


def flat_batch(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    bounds = [0]
    for p in prompts:
        bounds.append(bounds[-1] + len(p))
    return ids, positions, ForwardContext(metadata={KEY: bounds})


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Seeded weights of std 0.2 (norm weights too: a dropped multiply must show)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))


class PassThrough:
    """Attention stand-in that returns q: no ops of its own in a profile."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        return q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiny_qwen3_logits_match_torch_path(dtype: torch.dtype) -> None:
    raw, tensors = tiny_qwen3(torch.Generator().manual_seed(0), 96, 3)
    model = Qwen3ForCausalLM(Qwen3Config.from_hf_dict(raw), lambda i, kind: CausalSdpa(),
                             dtype, "cpu")
    model.load_weights(tensors.items())
    ids, positions, ctx = flat_batch(PROMPTS)
    with torch.no_grad():
        with triton_path(False):
            expected = model.compute_logits(model(ids, positions, ctx))
        with triton_path(True):
            actual = model.compute_logits(model(ids, positions, ctx))
    scale = float(expected.abs().max())
    assert scale > 1.0  # logits large enough that a wrong op would show
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale)
    else:
        # Two 2-layer bf16 runs whose roundings may each land a step apart (see
        # fused_testing.assert_same_values) drift by a few bf16 steps of the logit
        # scale; a wrong op moves logits by O(scale).
        torch.testing.assert_close(actual, expected, rtol=0, atol=4 * ULP[dtype] * scale)
        assert (actual.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_qwen3_next_attention_layer_matches_torch_path() -> None:
    raw, _ = tiny_qwen3_next(torch.Generator().manual_seed(0), 96, 3)
    c = Qwen3NextConfig.from_hf_dict(raw)
    rope = RotaryEmbedding(c.head_dim, max_position=c.max_position_embeddings,
                           base=c.rope_theta, rotary_dim=int(c.head_dim * c.partial_rotary_factor))
    assert rope.rotary_dim < c.head_dim
    layer = Qwen3NextDecoderLayer(c, "full_attention", CausalSdpa(), rope, dtype=torch.float32,
                                  device="cpu", tp=SINGLE)
    randomize(layer, seed=1)
    gen = torch.Generator().manual_seed(2)
    ids, positions, ctx = flat_batch(PROMPTS)
    x = torch.randn(len(ids), c.hidden_size, generator=gen)
    residual = torch.randn(len(ids), c.hidden_size, generator=gen)
    for res in (None, residual):
        with torch.no_grad():
            with triton_path(False):
                expected = layer(positions, x, res, ctx)
            with triton_path(True):
                actual = layer(positions, x, res, ctx)
        for a, e in zip(actual, expected, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_qwen3_layer_on_triton_path_leaves_only_matmuls() -> None:
    """Every norm, the rotary and the activation of a layer run as kernels."""
    raw, _ = tiny_qwen3(torch.Generator().manual_seed(0), 96, 3)
    c = Qwen3Config.from_hf_dict(raw)
    rope = RotaryEmbedding(c.head_dim, max_position=64, base=c.rope_theta)
    layer = Qwen3DecoderLayer(c, PassThrough(), rope, dtype=torch.float32, device="cpu",
                              tp=SINGLE)
    randomize(layer, seed=3)
    gen = torch.Generator().manual_seed(4)
    x, residual = (torch.randn(2, c.hidden_size, generator=gen) for _ in range(2))
    positions = torch.tensor([3, 4])

    def math_ops(on: bool) -> set[str]:
        with torch.no_grad(), triton_path(on), profile() as prof:
            layer(positions, x, residual, ForwardContext())
        return {e.name for e in prof.events()} & TORCH_MATH_OPS

    assert {"aten::rsqrt", "aten::silu", "aten::cat"} <= math_ops(False)
    assert math_ops(True) == set()
