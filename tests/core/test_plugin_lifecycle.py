"""Contract v3: what a backend may rely on, and the mistakes refused where they are made."""

from __future__ import annotations

import pytest
import torch

import kvrunner
from kvrunner import plugin_api
from kvrunner.layers.backend_layer import BackendLayer, BackendLayerError
from kvrunner.plugin_api import BackendError, CacheSpec, CacheWriteTarget, ForwardContext
from kvrunner.plugin_host.plugins import register_backend, unregister_backend
from kvrunner.runner.step.step_metadata import StepMetadataBuilder
from kvrunner.testing.harness import backend_manager, small_model_spec

FULL = "full_attention"


class Minimal:
    """A backend with one buffer, one pool and a layer that fails on request."""

    plugin_api_version = plugin_api.PLUGIN_API_VERSION
    layer_types = (FULL,)
    cache_rows = staticmethod(lambda name, pool: ("kv", pool))
    asked: list[int] = []

    def __init__(self, context) -> None:
        self.buffer = torch.full((8,), -1, dtype=torch.int64)

    @plugin_api.hookimpl
    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        return {"slot_mapping": self.buffer}

    @plugin_api.hookimpl
    def cache_spec(self) -> CacheSpec:
        return CacheSpec(bytes_per_block=4)  # one float32 a block

    @plugin_api.hookimpl
    def allocate_cache(self, num_blocks: int) -> dict[str, torch.Tensor]:
        return {"kv": torch.zeros(num_blocks)}

    @plugin_api.hookimpl
    def release_cache(self) -> None:  # required of a backend that allocates
        pass  # it keeps no reference to the pool

    @plugin_api.hookimpl
    def build_metadata(self, step) -> str:
        return "metadata only"

    @plugin_api.hookimpl
    def build_capture_metadata(self, step) -> None:
        return None  # builds nothing: the manager names the backend and the hook

    @plugin_api.hookimpl
    def cache_write_targets(self) -> list[CacheWriteTarget]:
        return [CacheWriteTarget(name="slot_mapping", buffer=self.buffer)]

    @plugin_api.hookimpl
    def make_layer(self, layer_index: int) -> _Failing:
        Minimal.asked.append(layer_index)
        return _Failing()


class _Failing:
    width = 3

    def forward(self, q, k, v, ctx):
        raise IndexError("index 9 is out of bounds")


@pytest.fixture
def minimal():
    register_backend("lifecycle", Minimal)
    Minimal.asked = []
    spec = small_model_spec((FULL, "linear_attention", FULL))
    yield lambda: backend_manager({FULL: "lifecycle"}, spec)
    unregister_backend("lifecycle")


def _step(builder_rows: int = 4):
    builder = StepMetadataBuilder(max_batch=4, max_tokens=8, max_blocks_per_seq=2,
                                  device=torch.device("cpu"))
    return builder.fill_capture(builder_rows)


def test_metadata_hooks_before_persistent_buffers_are_refused(minimal) -> None:
    manager = minimal()
    for call in (lambda: manager.cache_write_targets(),
                 lambda: manager.build_metadata(_step()),
                 lambda: manager.build_capture_metadata(_step())):
        with pytest.raises(BackendError, match="before persistent_buffers"):
            call()


def test_persistent_buffers_are_created_once(minimal) -> None:
    manager = minimal()
    first = manager.persistent_buffers(max_batch=4, max_tokens=8)
    again = manager.persistent_buffers(max_batch=4, max_tokens=8)
    assert again["lifecycle.slot_mapping"] is first["lifecycle.slot_mapping"]
    with pytest.raises(BackendError, match="refusing to reallocate"):
        manager.persistent_buffers(max_batch=8, max_tokens=8)


def test_allocations_and_releases_come_in_pairs(minimal) -> None:
    manager = minimal()
    manager.allocate_cache(num_blocks=3, num_slots=2)
    with pytest.raises(BackendError, match="twice without release_cache"):
        manager.allocate_cache(num_blocks=3, num_slots=2)
    manager.release_cache()
    manager.release_cache()  # a second release has nothing to release
    assert manager.allocate_cache(num_blocks=3, num_slots=2)["lifecycle.kv"].shape == (3,)


def test_metadata_is_keyed_by_the_backend_that_built_it(minimal) -> None:
    manager = minimal()
    manager.persistent_buffers(max_batch=4, max_tokens=8)
    ctx = manager.build_metadata(_step())
    assert ctx.for_backend("lifecycle") == "metadata only"
    with pytest.raises(TypeError, match="built str, not int"):
        ctx.for_backend("lifecycle", int)


def test_a_hook_that_builds_no_metadata_is_named(minimal) -> None:
    manager = minimal()
    manager.persistent_buffers(max_batch=4, max_tokens=8)
    with pytest.raises(BackendError, match="'lifecycle': build_capture_metadata returned no"):
        manager.build_capture_metadata(_step())


def test_make_layer_asks_only_the_selected_backend_for_its_own_layers(minimal) -> None:
    manager = minimal()
    layer = manager.make_layer(layer_index=2, layer_type=FULL)
    assert isinstance(layer, BackendLayer) and isinstance(layer.impl, _Failing)
    assert layer.width == 3  # attributes reach the backend's object
    with pytest.raises(BackendError, match="no active backend serves layer 1"):
        manager.make_layer(layer_index=1, layer_type=FULL)
    with pytest.raises(BackendError, match="no active backend serves layer 1"):
        manager.make_layer(layer_index=1, layer_type="linear_attention")
    assert Minimal.asked == [2]


def test_an_exception_in_a_layer_names_the_backend_and_the_layer(minimal) -> None:
    layer = minimal().make_layer(layer_index=2, layer_type=FULL)
    x = torch.zeros(1, 4, 16)
    with pytest.raises(BackendLayerError, match=r"backend 'lifecycle', layer 2 \(full_attention\)"
                       r": forward raised IndexError: index 9") as raised:
        layer.forward(x, x, x, ForwardContext())
    assert isinstance(raised.value.__cause__, IndexError)
    assert not isinstance(raised.value, kvrunner.KvrunnerError)  # a bug: keeps its traceback


def test_a_hook_named_method_without_hookimpl_is_refused_at_load() -> None:
    class Forgot(Minimal):
        def build_capture_metadata(self, step):  # no @plugin_api.hookimpl
            return "never called"

    with pytest.raises(BackendError, match=r"'forgot'.*build_capture_metadata.*no @kvrunner"):
        register_backend("forgot", Forgot)


def test_a_factory_functions_backend_is_checked_for_unmarked_hooks_when_built() -> None:
    class Forgot(Minimal):
        def cache_write_targets(self):  # no @plugin_api.hookimpl
            return []

    def factory(context):
        return Forgot(context)

    factory.plugin_api_version, factory.layer_types = plugin_api.PLUGIN_API_VERSION, (FULL,)
    factory.cache_rows = Minimal.cache_rows
    register_backend("forgot-later", factory)  # a function: nothing to inspect yet
    try:
        with pytest.raises(BackendError, match=r"'forgot-later'.*cache_write_targets.*no @"):
            backend_manager({FULL: "forgot-later"}, small_model_spec())
    finally:
        unregister_backend("forgot-later")
