"""The layer on its fla path: the conv writes q, k and v as three dense tensors, which
fla's kernels take without a copy, and the layer serves what its Triton path serves.

On the CPU, around the naive oracle in fla's layout (gdn_testkit's stand-in; fla's
kernels do not run under the Triton interpreter): this checks the layer's wiring (the
sectioned conv, the split, the prefill wrapper), not fla.
"""

from __future__ import annotations

import pytest
import torch
from gdn_testkit import (
    DEVICE,
    MAX_SEQS,
    TINY_MODEL,
    TOL,
    make_manager,
    oracle_in_fla_layout,
    rel_rms,
    step_metadata,
    unguarded,
)

import kvrunner_gdn.layer as layer_module
from kvrunner_gdn.layer import GDNLayer

LAYER = TINY_MODEL.layers_of_type("linear_attention")[0]


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the stand-in runs on the CPU")
def test_the_fla_path_takes_dense_q_k_v_and_serves_what_the_triton_path_does(monkeypatch):
    """Three fresh prompts, then a mixed step continuing them (one token for one of
    them, more for the others): outputs and pools after each step as the Triton path's,
    from the same pools; every q, k and v fla receives is contiguous."""
    dense = []

    def recorded(q, k, v, *args, **kwargs):
        dense.append(all(t.is_contiguous() for t in (q, k, v)))
        return oracle_in_fla_layout(q, k, v, *args, **kwargs)

    monkeypatch.setattr(layer_module, "fla_chunk_kernel", lambda: unguarded(recorded))
    manager = make_manager(use_triton=True)
    manager.persistent_buffers(max_batch=MAX_SEQS, max_tokens=128)
    pools = manager.allocate_cache(num_blocks=8, num_slots=MAX_SEQS + 1)
    ours = manager.make_layer(layer_index=LAYER, layer_type="linear_attention")
    assert ours.prefill_kernel == "triton"
    fla = GDNLayer(layer_index=ours.layer_index, backend_name=ours.backend_name,
                   shapes=ours.shapes, pool=ours.pool, use_triton=True,
                   chunk_size=ours.chunk_size, prefill_kernel="fla")
    sh = ours.shapes
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(sh.conv_dim, sh.conv_kernel, generator=gen)
    for t in pools.values():
        t.copy_(torch.randn(t.shape, generator=gen))  # stale bytes: fresh rows must not read them
    slots, starts = [3, 0, 2], [0, 0, 0]
    for lens in ([5, 17, 2], [1, 9, 4]):
        ctx = manager.build_metadata(step_metadata(lens, starts, slots))
        tokens = sum(lens)
        x = torch.randn(tokens, sh.conv_dim, generator=gen)
        g = -torch.rand(tokens, sh.num_value_heads, generator=gen)
        beta = torch.rand(tokens, sh.num_value_heads, generator=gen)
        before = {name: t.clone() for name, t in pools.items()}
        want = ours.forward(x, g, beta, weight, None, ctx)
        want_pools = {name: t.clone() for name, t in pools.items()}
        for name, t in pools.items():
            t.copy_(before[name])
        got = fla.forward(x, g, beta, weight, None, ctx)
        assert rel_rms(got, want) < TOL, f"step {lens}: output"
        for name, t in pools.items():
            assert rel_rms(t, want_pools[name]) < TOL, f"step {lens}: pool {name}"
        starts = [s + n for s, n in zip(starts, lens, strict=True)]
    assert dense == [True, True]
