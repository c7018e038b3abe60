"""The ``gdn`` backend's hooks, called through a real :class:`kvrunner.plugins.BackendManager`.

The capture-safety contract is the point: every index buffer the kernels write
through is declared (one of them lives on the builder, outside forward_vars);
capture metadata never touches the write side; and once the core has blanked the
declared targets, a captured forward writes no state at all.
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
    same_bytes,
    step_batch,
)
from hypothesis import given
from hypothesis import strategies as st

from kvrunner import PAD_SLOT_ID
from kvrunner.plugins import BackendError
from kvrunner_gdn.backend import GDNBackend
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
    (spec,) = manager.cache_specs()
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
    assert {t.name for t in targets} == set(GDNBackend.write_targets)
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
    manager.build_metadata(step_batch([1] * MAX_SEQS, [1] * MAX_SEQS, everyone))
    manager.build_metadata(step_batch([2] * MAX_SEQS, [1] * MAX_SEQS, everyone))
    n = len(lens)
    slots = data.draw(st.permutations(range(NUM_SLOTS)))[:n]
    starts = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    decode = data.draw(st.booleans())
    if decode:
        lens = [1] * n
    elif max(lens) == 1:
        lens = [2, *lens[1:]]  # one token per sequence would make it a decode batch
    padded = data.draw(st.integers(n, MAX_SEQS)) if decode else n
    md = manager.build_metadata(step_batch(lens, starts, slots, padded)).for_backend("gdn")
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


@pytest.mark.parametrize("batch_size", [1, 3, MAX_SEQS])
def test_capture_metadata_leaves_the_write_side_as_it_was(batch_size):
    """After real steps filled the write buffers, capture metadata changes none of their
    bytes (the core blanks them; a builder that rewrote them would undo or fake that)."""
    manager = make_manager(use_triton=False)
    manager.persistent_buffers(max_batch=MAX_SEQS, max_tokens=64)
    manager.build_metadata(step_batch([3, 2], [0, 4], [4, 1]))  # prefill-side buffers
    manager.build_metadata(step_batch([1, 1, 1], [5, 2, 9], [2, 0, 3]))  # decode buffers
    before = {t.name: t.buffer.clone() for t in manager.cache_write_targets()}
    md = manager.build_capture_metadata(batch_size).for_backend("gdn")
    for t in manager.cache_write_targets():
        assert same_bytes(t.buffer, before[t.name]), f"capture metadata rewrote {t.name}"
    assert md.is_decode and md.num_rows == batch_size
    targets = {t.name: t for t in manager.cache_write_targets()}
    decode_target = targets["decode_state_indices"]
    assert md.write_indices.data_ptr() == decode_target.buffer.data_ptr()
    assert ((md.read_indices == PAD_SLOT_ID) | (md.read_indices < NUM_SLOTS)).all()


def _capture_forward(manager, batch_size: int, gen: torch.Generator) -> list[torch.Tensor]:
    ctx = manager.build_capture_metadata(batch_size)
    outs = []
    for i in GDN_LAYERS:
        layer = manager.make_layer(layer_index=i, layer_type="linear_attention")
        outs.append(layer.forward(*_layer_inputs(layer, batch_size, gen), ctx))
    return outs


@pytest.mark.parametrize("use_triton", PATHS)
def test_blanked_capture_forward_writes_no_state(use_triton):
    """The core's capture sequence: blank every declared target, build capture metadata,
    run the model for real. Every pool must come back byte-identical."""
    manager = make_manager(use_triton)
    manager.persistent_buffers(max_batch=MAX_SEQS, max_tokens=64)
    pools = _allocate(manager)
    manager.build_metadata(step_batch([1, 1, 1, 1], [3, 3, 3, 3], [0, 1, 2, 3]))
    snapshot = {k: t.clone() for k, t in pools.items()}
    gen = torch.Generator().manual_seed(0)
    for batch_size in (MAX_SEQS, 2, 1):  # largest first, as the runner captures
        for t in manager.cache_write_targets():
            t.buffer.fill_(t.pad_value)
        outs = _capture_forward(manager, batch_size, gen)
        assert all(torch.count_nonzero(o) == 0 for o in outs)
    for key, t in pools.items():
        assert same_bytes(t, snapshot[key]), f"capture wrote into {key}"


@pytest.mark.parametrize("use_triton", PATHS)
def test_unblanked_capture_would_write_live_state(use_triton):
    """The control: skip the blanking and the same capture overwrites the slots the last
    real batch left in the write buffers. This is the defect blanking exists to stop."""
    manager = make_manager(use_triton)
    manager.persistent_buffers(max_batch=MAX_SEQS, max_tokens=64)
    pools = _allocate(manager)
    manager.build_metadata(step_batch([1, 1], [3, 3], [2, 0]))
    snapshot = {k: t.clone() for k, t in pools.items()}
    _capture_forward(manager, 2, torch.Generator().manual_seed(0))
    changed = {k for k, t in pools.items() if not same_bytes(t, snapshot[k])}
    assert changed == set(pools)


def test_make_layer_answers_only_for_its_linear_attention_layers():
    manager = make_manager(use_triton=False)
    for i in GDN_LAYERS:
        layer = manager.make_layer(layer_index=i, layer_type="linear_attention")
        assert isinstance(layer, GDNLayer) and layer.layer_index == i
        assert layer.conv_dim == layer.shapes.conv_dim
    full = TINY_MODEL.layers_of_type("full_attention")
    with pytest.raises(BackendError, match="no active backend made layer"):
        manager.make_layer(layer_index=full[0], layer_type="full_attention")
    (backend,) = manager.pm.get_plugins()
    assert backend.make_layer(layer_index=full[0], layer_type="linear_attention") is None


def test_forward_after_release_fails_loudly():
    manager = make_manager(use_triton=False)
    _allocate(manager)
    layer = manager.make_layer(layer_index=GDN_LAYERS[0], layer_type="linear_attention")
    manager.release_cache()
    ctx = manager.build_metadata(step_batch([1], [0], [0]))
    with pytest.raises(RuntimeError, match="not allocated"):
        layer.forward(*_layer_inputs(layer, 1, torch.Generator().manual_seed(0)), ctx)


def test_a_model_without_linear_shapes_is_refused_at_load():
    import attrs

    bad = attrs.evolve(TINY_MODEL, linear_num_value_heads=3)  # not a multiple of key heads
    with pytest.raises(BackendError, match="multiple"):
        make_manager(use_triton=False, model=bad)
