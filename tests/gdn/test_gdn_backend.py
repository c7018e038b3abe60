"""The ``gdn`` backend's own hooks, called through a real
:class:`kvrunner.plugin_host.backend_manager.BackendManager`.

What every backend must do (steps equal the reference, PAD rows and captures write
nothing, replays see later fills) is proved by the conformance kit
(``tests/conformance``); here: its pools, its read/write state indices, and that
one of its write targets lives outside forward_vars.
"""

from __future__ import annotations

import pytest
import torch
from gdn_testkit import (
    DEVICE,
    MAX_SEQS,
    PAD,
    TINY_MODEL,
    make_manager,
    step_metadata,
)
from hypothesis import given
from hypothesis import strategies as st

from kvrunner.plugin_api import PAD_SLOT_ID, BackendError
from kvrunner_gdn.layer import GDNLayer

PATHS = [pytest.param(True, id="triton"), pytest.param(False, id="torch")]
NUM_SLOTS = MAX_SEQS + 1
GDN_LAYERS = TINY_MODEL.layers_of_type("linear_attention")


def _allocate(manager, seed: int = 0) -> dict[str, torch.Tensor]:
    """Allocate the pools and fill them with random state, as a served run leaves them."""
    pools = manager.allocate_cache(num_blocks=8, num_slots=NUM_SLOTS)
    gen = torch.Generator().manual_seed(seed)
    for t in pools.values():
        t.copy_(torch.randn(t.shape, generator=gen))
    return pools


def _layer_inputs(layer: GDNLayer, tokens: int, gen: torch.Generator):
    sh = layer.shapes
    r = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)
    g = (-torch.rand(tokens, sh.num_value_heads, generator=gen)).to(DEVICE)
    beta = torch.rand(tokens, sh.num_value_heads, generator=gen).to(DEVICE)
    return r(tokens, sh.conv_dim), g, beta, r(sh.conv_dim, sh.conv_kernel), r(sh.conv_dim)


def test_cache_spec_counts_exactly_the_allocated_state_per_slot():
    manager = make_manager(use_triton=False)
    spec = manager.cache_specs()["gdn"]
    pools = manager.allocate_cache(num_blocks=8, num_slots=NUM_SLOTS)
    assert set(pools) == {f"gdn.{kind}.{i}" for i in GDN_LAYERS for kind in ("conv", "ssm")}
    per_slot = sum(t[0].numel() * t.element_size() for t in pools.values())
    assert spec.bytes_per_block == 0
    assert spec.bytes_per_slot == per_slot
    m = TINY_MODEL
    conv_dim = 2 * m.linear_num_key_heads * m.linear_key_head_dim
    conv_dim += m.linear_num_value_heads * m.linear_value_head_dim
    for i in GDN_LAYERS:
        conv, ssm = pools[f"gdn.conv.{i}"], pools[f"gdn.ssm.{i}"]
        assert conv.shape == (NUM_SLOTS, conv_dim, m.linear_conv_kernel_dim - 1)
        assert ssm.shape == (NUM_SLOTS, m.linear_num_value_heads, m.linear_key_head_dim,
                             m.linear_value_head_dim)
        assert conv.dtype == ssm.dtype == torch.float32


def test_write_targets_include_a_buffer_outside_forward_vars():
    manager = make_manager(use_triton=False)
    forward_vars = manager.persistent_buffers(max_batch=MAX_SEQS, max_tokens=64)
    targets = manager.cache_write_targets()
    assert {t.name for t in targets} == {"decode_state_indices", "prefill_state_indices_in_tensor"}
    assert all(t.pad_value == PAD_SLOT_ID for t in targets)
    assert all(not t.buffer.dtype.is_floating_point for t in targets)
    fv_storages = {b.untyped_storage().data_ptr() for b in forward_vars.values()}
    outside = [t for t in targets if t.buffer.untyped_storage().data_ptr() not in fv_storages]
    inside = [t for t in targets if t.buffer.untyped_storage().data_ptr() in fv_storages]
    assert outside, "every write target is in forward_vars; the builder's must be declared too"
    assert inside, "the decode write side (forward_vars) must be declared"


@given(
    lens=st.lists(st.integers(1, 5), min_size=1, max_size=MAX_SEQS),
    data=st.data(),
)
def test_build_metadata_fills_heads_and_pads_tails(lens, data):
    manager = make_manager(use_triton=False)
    manager.persistent_buffers(max_batch=MAX_SEQS, max_tokens=64)
    # Earlier full-width steps leave every row of every index buffer holding a slot.
    everyone = list(range(MAX_SEQS))
    manager.build_metadata(step_metadata([1] * MAX_SEQS, [1] * MAX_SEQS, everyone))
    manager.build_metadata(step_metadata([2] * MAX_SEQS, [1] * MAX_SEQS, everyone))
    n = len(lens)
    slots = data.draw(st.permutations(range(NUM_SLOTS)))[:n]
    starts = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    decode = data.draw(st.booleans())
    if decode:
        lens = [1] * n
    elif max(lens) == 1:
        lens = [2, *lens[1:]]  # one token per sequence would make it a decode batch
    padded = data.draw(st.integers(n, MAX_SEQS)) if decode else n
    md = manager.build_metadata(step_metadata(lens, starts, slots, padded)).for_backend("gdn")
    assert md.is_decode == decode
    assert md.num_rows == padded
    expected_read = [s if p > 0 else PAD for s, p in zip(slots, starts, strict=True)]
    assert md.write_indices[:n].tolist() == slots
    assert md.read_indices[:n].tolist() == expected_read
    # The kernels write through a view of a declared target, whose tail is PAD.
    name = "decode_state_indices" if decode else "prefill_state_indices_in_tensor"
    (target,) = [t for t in manager.cache_write_targets() if t.name == name]
    assert md.write_indices.data_ptr() == target.buffer.data_ptr()
    assert (target.buffer[n:] == PAD_SLOT_ID).all(), f"{name} tail not PAD"
    if not decode:
        assert md.cu_seqlens.tolist() == [0, *torch.tensor(lens).cumsum(0).tolist()]


def test_make_layer_builds_one_layer_per_linear_attention_layer():
    manager = make_manager(use_triton=False)
    for i in GDN_LAYERS:
        layer = manager.make_layer(layer_index=i, layer_type="linear_attention")
        assert isinstance(layer.impl, GDNLayer) and layer.layer_index == i
        assert layer.conv_dim == layer.shapes.conv_dim
    full = TINY_MODEL.layers_of_type("full_attention")
    with pytest.raises(BackendError, match="no active backend serves layer"):
        manager.make_layer(layer_index=full[0], layer_type="full_attention")


def test_forward_after_release_fails_loudly():
    manager = make_manager(use_triton=False)
    _allocate(manager)
    layer = manager.make_layer(layer_index=GDN_LAYERS[0], layer_type="linear_attention")
    manager.persistent_buffers(max_batch=MAX_SEQS, max_tokens=64)
    manager.release_cache()
    ctx = manager.build_metadata(step_metadata([1], [0], [0]))
    with pytest.raises(RuntimeError, match="not allocated"):
        layer.forward(*_layer_inputs(layer, 1, torch.Generator().manual_seed(0)), ctx)


def test_a_model_without_linear_shapes_is_refused_at_load():
    import attrs

    bad = attrs.evolve(TINY_MODEL, linear_num_value_heads=3)  # not a multiple of key heads
    with pytest.raises(BackendError, match="multiple"):
        make_manager(use_triton=False, model=bad)
