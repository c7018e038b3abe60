"""Our oracle and our layer agree with Hugging Face's Qwen3-Next implementation.

The kernels are tested against the naive definitions (``kvrunner_gdn.ops.*.naive``); this file pins
that reference (and the layer's channel layout) to transformers' own
``Qwen3NextGatedDeltaNet`` math, so "matches the oracle" means "matches the model".
"""

from __future__ import annotations

import pytest
import torch
from gdn_testkit import DEVICE, MAX_SEQS, TOL, make_manager, rel_rms, step_metadata

from kvrunner.plugin_api import ModelSpec
from kvrunner_gdn.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
from kvrunner_gdn.ops.short_conv.naive import naive_short_conv

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
Qwen3NextConfig = pytest.importorskip("transformers").Qwen3NextConfig


def test_reference_recurrence_matches_hf_with_initial_state():
    gen = torch.Generator().manual_seed(0)
    length, hk, hv, dk, dv = 7, 2, 4, 16, 8
    q, k = torch.randn(length, hk, dk, generator=gen), torch.randn(length, hk, dk, generator=gen)
    v = torch.randn(length, hv, dv, generator=gen)
    g, beta = -torch.rand(length, hv, generator=gen), torch.rand(length, hv, generator=gen)
    s0 = torch.randn(hv, dk, dv, generator=gen)
    # Older transformers' function lacks the key-head repeat (the module does it), so
    # hand it value-head-many keys; ours must reach the same via h // (Hv // Hk).
    rep = lambda t: t.repeat_interleave(hv // hk, dim=1)[None]
    hf_out, hf_state = hf.torch_recurrent_gated_delta_rule(
        rep(q), rep(k), v[None], g=g[None], beta=beta[None], initial_state=s0[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    out, state = naive_recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    assert rel_rms(out, hf_out[0]) < TOL
    assert rel_rms(state, hf_state[0]) < TOL


def test_reference_conv_matches_hf_conv_update_state_convention():
    """HF's decode conv keeps the last kernel-1 inputs oldest first, as our pool does."""
    gen = torch.Generator().manual_seed(1)
    dim, width, length = 12, 4, 3
    x = torch.randn(length, dim, generator=gen)
    weight = torch.randn(dim, width, generator=gen)
    state = torch.randn(dim, width - 1, generator=gen)
    hf_state = state[None].clone()
    hf_out = hf.causal_conv1d_update(x.T[None], hf_state, weight, None, "silu")
    out, final = naive_short_conv(x, weight, None, state)
    assert rel_rms(out, hf_out[0].T) < TOL
    assert rel_rms(final, hf_state[0]) < TOL


@pytest.mark.parametrize("use_triton", [pytest.param(True, id="triton"),
                                        pytest.param(False, id="torch")])
def test_layer_inside_hf_gated_deltanet_reproduces_its_output(use_triton):
    """Run HF's module on a prompt; then do its projections, our layer, its norm and
    out_proj. The two outputs agree: the layer's API fits the model as documented."""
    config = Qwen3NextConfig(
        hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    mod = hf.Qwen3NextGatedDeltaNet(config, layer_idx=0).float().eval()
    with torch.no_grad():
        mod.dt_bias.normal_()
        mod.norm.weight.uniform_(0.5, 1.5)
        hidden = torch.randn(1, 21, 32)
        expected = mod(hidden)

        spec = ModelSpec(
            num_layers=1, layer_types=("linear_attention",), num_heads=1, num_kv_heads=1,
            head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        )
        manager = make_manager(use_triton, model=spec)
        manager.persistent_buffers(max_batch=MAX_SEQS, max_tokens=128)
        manager.allocate_cache(num_blocks=1, num_slots=MAX_SEQS + 1)
        layer = manager.make_layer(layer_index=0, layer_type="linear_attention")
        ctx = manager.build_metadata(step_metadata([21], [0], [2]))

        q, k, v, z, b, a = mod.fix_query_key_value_ordering(
            mod.in_proj_qkvz(hidden), mod.in_proj_ba(hidden)
        )
        mixed_qkv = torch.cat([t.reshape(21, -1) for t in (q, k, v)], dim=-1)
        g = -mod.A_log.float().exp() * torch.nn.functional.softplus(a[0].float() + mod.dt_bias)
        dev = lambda t: t.to(DEVICE)
        core = layer.forward(dev(mixed_qkv), dev(g), dev(b[0].sigmoid()),
                             dev(mod.conv1d.weight), None, ctx).cpu()
        normed = mod.norm(core.reshape(-1, 8), z.reshape(-1, 8)).reshape(1, 21, -1)
        actual = mod.out_proj(normed)
    assert rel_rms(actual, expected) < TOL
