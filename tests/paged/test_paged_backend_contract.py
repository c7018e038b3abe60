"""The paged backend as the core sees it: discovery, sizing, pools, buffers, write targets."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch

from kvrunner.plugin_api import PAD_SLOT_ID, BackendError, CacheSpec, ForwardContext, ModelSpec
from kvrunner.plugin_host.backend_manager import BackendManager
from kvrunner.runner.step.step_metadata import StepMetadataBuilder
from kvrunner.testing.harness import backend_manager
from kvrunner_paged import PagedAttention, PagedBackend

FULL, LINEAR = "full_attention", "linear_attention"
HYBRID = (FULL, LINEAR, FULL)  # paged serves layers 0 and 2


def _spec(num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16) -> ModelSpec:
    return ModelSpec(
        num_layers=len(HYBRID), layer_types=HYBRID, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim,
    )


def _step_builder() -> StepMetadataBuilder:
    return StepMetadataBuilder(max_batch=4, max_tokens=8, max_blocks_per_seq=16,
                               device=torch.device("cpu"))


def _manager(**kwargs: object) -> BackendManager:
    spec = kwargs.pop("spec", _spec())
    return backend_manager({FULL: "paged"}, spec, **kwargs)  # type: ignore[arg-type]


def test_entry_point_paged_loads_the_backend_class() -> None:
    (ep,) = entry_points(group="kvrunner.backends", name="paged")
    assert ep.load() is PagedBackend
    assert ep.dist is not None and ep.dist.name == "kvrunner-paged"
    assert PagedBackend.layer_types == (FULL,)


@pytest.mark.parametrize(("dtype", "element"), [(torch.float32, 4), (torch.bfloat16, 2)])
def test_cache_spec_counts_keys_and_values_of_every_served_layer(
    dtype: torch.dtype, element: int
) -> None:
    specs = _manager(block_size=8, dtype=dtype, spec=_spec(4, 2, 32)).cache_specs()
    per_layer = 2 * 8 * 2 * 32 * element  # k+v * block_size * kv_heads * head_dim * bytes
    assert specs == {"paged": CacheSpec(bytes_per_block=2 * per_layer, bytes_per_slot=0)}


def test_allocate_cache_returns_one_pool_per_served_layer_and_release_drops_them() -> None:
    mgr = _manager(block_size=4)
    pools = mgr.allocate_cache(num_blocks=7, num_slots=5)
    assert sorted(pools) == ["paged.kv.0", "paged.kv.2"]
    for pool in pools.values():
        assert pool.shape == (2, 7, 4, 2, 16) and pool.dtype == torch.float32
    assert pools["paged.kv.0"].data_ptr() != pools["paged.kv.2"].data_ptr()

    mgr.persistent_buffers(max_batch=2, max_tokens=8)
    layer = mgr.make_layer(layer_index=0, layer_type=FULL)
    mgr.release_cache()
    ctx = mgr.build_capture_metadata(_step_builder().fill_capture(1))
    x = torch.zeros((1, 4, 16))
    with pytest.raises(RuntimeError, match="released"):
        layer.forward(x, x[:, :2], x[:, :2], ctx)
    # A wake allocates again; the same layer object serves from the new pool.
    mgr.allocate_cache(num_blocks=7, num_slots=5)
    assert torch.isfinite(layer.forward(x, x[:, :2], x[:, :2], ctx)).all()


def test_persistent_buffers_are_only_its_write_side_sized_once() -> None:
    mgr = _manager(block_size=4, max_model_len=30)
    buffers = mgr.persistent_buffers(max_batch=3, max_tokens=16)
    # The read side (block tables, lengths, offsets) is the core's shared step metadata.
    assert {k: (tuple(v.shape), v.dtype) for k, v in buffers.items()} == {
        "paged.slot_mapping": ((16,), torch.int64),
    }
    assert buffers["paged.slot_mapping"].eq(PAD_SLOT_ID).all()  # nothing writes before a step
    again = mgr.persistent_buffers(max_batch=3, max_tokens=16)
    assert all(again[k] is buffers[k] for k in buffers)
    with pytest.raises(BackendError, match="refusing to reallocate"):
        mgr.persistent_buffers(max_batch=4, max_tokens=16)


def test_cache_write_targets_declare_the_registered_slot_mapping_buffer() -> None:
    mgr = _manager()
    buffers = mgr.persistent_buffers(max_batch=2, max_tokens=8)
    (target,) = mgr.cache_write_targets()
    assert target.buffer is buffers["paged.slot_mapping"]
    assert target.qualified_name == "paged.slot_mapping"
    assert target.pad_value == PAD_SLOT_ID


def test_hooks_that_need_buffers_say_so_when_called_first() -> None:
    mgr = _manager()
    with pytest.raises(BackendError, match="before persistent_buffers"):
        mgr.cache_write_targets()
    with pytest.raises(BackendError, match="before persistent_buffers"):
        mgr.build_capture_metadata(_step_builder().fill_capture(1))


def test_make_layer_builds_attention_over_the_layers_own_pool() -> None:
    mgr = _manager()
    layer = mgr.make_layer(layer_index=2, layer_type=FULL)
    assert isinstance(layer.impl, PagedAttention) and layer.impl.layer_index == 2
    with pytest.raises(BackendError, match="no active backend serves layer 1"):
        mgr.make_layer(layer_index=1, layer_type=LINEAR)


def test_a_head_count_that_does_not_group_is_refused_at_load() -> None:
    with pytest.raises(BackendError, match="multiple of num_kv_heads"):
        _manager(spec=_spec(num_heads=3, num_kv_heads=2))


def test_build_capture_metadata_rejects_rows_past_its_slot_mapping() -> None:
    mgr = _manager()
    mgr.persistent_buffers(max_batch=2, max_tokens=2)
    with pytest.raises(BackendError, match="3 token rows exceed the paged slot_mapping"):
        mgr.build_capture_metadata(_step_builder().fill_capture(3))


def test_layer_reads_metadata_under_the_backend_name() -> None:
    mgr = _manager()
    mgr.allocate_cache(num_blocks=2, num_slots=3)
    mgr.persistent_buffers(max_batch=2, max_tokens=8)
    layer = mgr.make_layer(layer_index=0, layer_type=FULL)
    x = torch.zeros((1, 4, 16))
    with pytest.raises(RuntimeError, match="no metadata was built for backend 'paged'"):
        layer.forward(x, x[:, :2], x[:, :2], ForwardContext())
