"""The layer object the model calls, driven step by step through the backend's metadata.

Sequences are prefilled from NaN-poisoned slots, continued in a mixed step (some
decode one token, some prefill another chunk), then decoded in a padded batch. Each
sequence's outputs must equal the naive conv + recurrence over all its tokens at
once: the state crosses steps and paths through the pool, and nothing else leaks in.
"""

from __future__ import annotations

import pytest
import torch
from gdn_testkit import DEVICE, MAX_SEQS, TINY_MODEL, TOL, make_manager, rel_rms, step_metadata
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrunner_gdn.layer import GDNLayer
from kvrunner_gdn.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
from kvrunner_gdn.ops.short_conv.naive import naive_short_conv

PATHS = [pytest.param(True, id="triton"), pytest.param(False, id="torch")]
LAYER = TINY_MODEL.layers_of_type("linear_attention")[1]


def reference_layer(layer: GDNLayer, mixed_qkv, g, beta, weight) -> torch.Tensor:
    """Conv + split + gated delta rule over one whole sequence, from zero state."""
    sh = layer.shapes
    x, _ = naive_short_conv(mixed_qkv.cpu(), weight.cpu(), None, None)
    q = x[:, : sh.key_dim].unflatten(1, (sh.num_key_heads, sh.head_k_dim))
    k = x[:, sh.key_dim : 2 * sh.key_dim].unflatten(1, (sh.num_key_heads, sh.head_k_dim))
    v = x[:, 2 * sh.key_dim :].unflatten(1, (sh.num_value_heads, sh.head_v_dim))
    out, _ = naive_recurrent_gated_delta_rule(q, k, v, g.cpu(), beta.cpu(), None)
    return out


@pytest.mark.parametrize("use_triton", PATHS)
@settings(max_examples=6)
@given(
    prompts=st.lists(st.integers(1, 20), min_size=1, max_size=3),
    data=st.data(),
)
def test_prefill_mixed_and_padded_decode_steps_equal_one_recurrence(use_triton, prompts, data):
    manager = make_manager(use_triton)
    (backend,) = manager.pm.get_plugins()
    backend.chunk_size = 16  # several chunks per prompt, and fast under the interpreter
    manager.persistent_buffers(max_batch=MAX_SEQS, max_tokens=128)
    pools = manager.allocate_cache(num_blocks=8, num_slots=MAX_SEQS + 1)
    for t in pools.values():
        t.fill_(float("nan"))  # whatever a slot held before must never be read
    layer = manager.make_layer(layer_index=LAYER, layer_type="linear_attention")
    sh = layer.shapes
    n = len(prompts)
    slots = data.draw(st.permutations(range(MAX_SEQS + 1)))[:n]
    second = data.draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    padded = data.draw(st.integers(n, MAX_SEQS))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    weight = torch.randn(sh.conv_dim, sh.conv_kernel, generator=gen).to(DEVICE)

    def inputs(tokens: int):
        return (
            torch.randn(tokens, sh.conv_dim, generator=gen).to(DEVICE),
            (-torch.rand(tokens, sh.num_value_heads, generator=gen)).to(DEVICE),
            torch.rand(tokens, sh.num_value_heads, generator=gen).to(DEVICE),
        )

    history = [[] for _ in range(n)]  # per sequence: (mixed_qkv, g, beta, out) per step
    starts = [0] * n
    for lens, rows in ((prompts, None), (second, None), ([1] * n, padded)):
        batch = step_metadata(lens, starts, slots, rows)
        ctx = manager.build_metadata(batch)
        tokens = rows if rows is not None else sum(lens)
        x, g, beta = inputs(tokens)  # padded rows carry garbage input, as a graph replay does
        out = layer.forward(x, g, beta, weight, None, ctx)
        assert out.shape == (tokens, sh.num_value_heads, sh.head_v_dim)
        cu = batch.host.cu_query_lens.tolist()
        for i in range(n):
            piece = slice(cu[i], cu[i + 1])
            history[i].append((x[piece], g[piece], beta[piece], out[piece]))
        assert torch.count_nonzero(out[cu[-1] :]) == 0, "padded rows must output zeros"
        starts = [s + q for s, q in zip(starts, lens, strict=True)]

    for i in range(n):
        x, g, beta, out = (torch.cat(parts) for parts in zip(*history[i], strict=True))
        expected = reference_layer(layer, x, g, beta, weight)
        assert rel_rms(out, expected) < TOL, f"sequence {i} (prompt {prompts[i]})"


def test_layer_accepts_hf_conv_weight_layout():
    """HF keeps conv1d.weight as [conv_dim, 1, kernel]; the layer takes it unchanged."""
    manager = make_manager(use_triton=False)
    manager.persistent_buffers(max_batch=MAX_SEQS, max_tokens=128)
    manager.allocate_cache(num_blocks=8, num_slots=MAX_SEQS + 1)
    layer = manager.make_layer(layer_index=LAYER, layer_type="linear_attention")
    sh = layer.shapes
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, sh.conv_dim, generator=gen).to(DEVICE)
    g = (-torch.rand(6, sh.num_value_heads, generator=gen)).to(DEVICE)
    beta = torch.rand(6, sh.num_value_heads, generator=gen).to(DEVICE)
    w = torch.randn(sh.conv_dim, sh.conv_kernel, generator=gen).to(DEVICE)
    ctx = manager.build_metadata(step_metadata([6], [0], [1]))
    out = layer.forward(x, g, beta, w[:, None, :], None, ctx)
    assert rel_rms(out, reference_layer(layer, x, g, beta, w)) < TOL
