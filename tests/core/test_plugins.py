"""Plugin discovery, selection and validation: every failure names the backend."""

from __future__ import annotations

import pytest
import torch

from kvrunner import plugin_api
from kvrunner.plugin_api import BackendError, CacheWriteTarget
from kvrunner.plugin_host.plugins import (
    BLOCK_ENV,
    discover_backends,
    register_backend,
    unregister_backend,
)
from kvrunner.runner.step.step_metadata import StepMetadataBuilder
from kvrunner.testing.harness import backend_manager, small_model_spec

ATTN = {"full_attention": "flatkv"}


def test_backend_installed_from_a_separate_package_is_discovered(flatkv_installed) -> None:
    found = discover_backends()
    assert found["flatkv"].distribution == "kvrunner-flatkv"
    assert found["flatkv"].version == "0.0.1"
    assert found["flatkv"].load().layer_types == ("full_attention",)


def test_only_selected_backends_are_registered(flatkv_installed) -> None:
    manager = backend_manager(ATTN, small_model_spec())
    assert manager.names == ["flatkv"]


def test_a_name_not_installed_lists_the_installed_ones(flatkv_installed) -> None:
    with pytest.raises(BackendError, match=r"'nope'.*not installed.*flatkv"):
        backend_manager({"full_attention": "nope"}, small_model_spec())


def test_blocked_backend_is_not_discovered_and_the_error_says_so(
    flatkv_installed, monkeypatch
) -> None:
    monkeypatch.setenv(BLOCK_ENV, "flatkv, other")
    assert "flatkv" not in discover_backends()
    with pytest.raises(BackendError, match=f"blocked by {BLOCK_ENV}"):
        backend_manager(ATTN, small_model_spec())


def test_backend_that_cannot_serve_the_layer_type_is_refused(flatkv_installed) -> None:
    with pytest.raises(BackendError, match=r"'flatkv' cannot serve.*linear_attention"):
        backend_manager({"linear_attention": "flatkv"}, small_model_spec(("linear_attention",)))


class _Base:
    plugin_api_version = plugin_api.PLUGIN_API_VERSION
    layer_types = ("full_attention",)
    cache_rows = staticmethod(lambda name, pool: ("kv", pool))

    def __init__(self, context) -> None:
        self.buffer = torch.full((8,), -1, dtype=torch.int64)


def _with_buffers(manager):
    """The manager as the runner leaves it before any metadata or capture hook."""
    manager.persistent_buffers(max_batch=4, max_tokens=8)
    return manager


def _capture_step(batch_size: int = 4):
    builder = StepMetadataBuilder(max_batch=4, max_tokens=8, max_blocks_per_seq=2,
                                  device=torch.device("cpu"))
    return builder.fill_capture(batch_size)


@pytest.fixture
def registered():
    names: list[str] = []

    def register(name, factory):
        register_backend(name, factory)
        names.append(name)

    yield register
    for name in names:
        unregister_backend(name)


def test_wrong_plugin_api_version_is_refused_at_load() -> None:
    class Old(_Base):
        plugin_api_version = plugin_api.PLUGIN_API_VERSION + 1

    with pytest.raises(BackendError, match=r"'old' targets plugin API"):
        register_backend("old", Old)


def test_misspelled_hook_is_caught_by_check_pending(registered) -> None:
    class Typo(_Base):
        @plugin_api.hookimpl
        def cache_write_target(self):  # missing "s"
            return []

    registered("typo", Typo)
    with pytest.raises(BackendError, match=r"typo.*cache_write_target"):
        backend_manager({"full_attention": "typo"}, small_model_spec())


@pytest.mark.parametrize(
    ("buffer", "pad", "problem"),
    [
        (torch.zeros(8), -1, "integer tensor"),
        (torch.zeros(8, dtype=torch.bool), -1, "integer tensor"),
        (torch.zeros(8, dtype=torch.int32), -1.0, "non-integer PAD"),
    ],
)
def test_write_targets_must_be_integer_tensors_with_an_integer_pad(
    registered, buffer, pad, problem
) -> None:
    class Bad(_Base):
        @plugin_api.hookimpl
        def cache_write_targets(self):
            return [
                CacheWriteTarget(name="slot_mapping", buffer=buffer, pad_value=pad)
            ]

    registered("bad", Bad)
    manager = _with_buffers(backend_manager({"full_attention": "bad"}, small_model_spec()))
    with pytest.raises(BackendError, match=f"'bad'.*{problem}"):
        manager.cache_write_targets()


def test_the_set_of_write_targets_is_fixed_by_the_first_answer(registered) -> None:
    class Changing(_Base):
        calls = 0

        @plugin_api.hookimpl
        def cache_write_targets(self):
            Changing.calls += 1
            name = "slot_mapping" if Changing.calls == 1 else "other"
            return [CacheWriteTarget(name=name, buffer=self.buffer)]

    registered("changing", Changing)
    manager = _with_buffers(backend_manager({"full_attention": "changing"}, small_model_spec()))
    (first,) = manager.cache_write_targets()
    assert first.qualified_name == "changing.slot_mapping"  # the manager names the owner
    with pytest.raises(BackendError, match=r"returned \['other'\], earlier \['slot_mapping'\]"):
        manager.cache_write_targets()


def test_a_write_target_claiming_another_backend_is_refused(registered) -> None:
    class Impostor(_Base):
        @plugin_api.hookimpl
        def cache_write_targets(self):
            return [CacheWriteTarget(name="slot_mapping", buffer=self.buffer, backend="paged")]

    registered("impostor", Impostor)
    manager = _with_buffers(backend_manager({"full_attention": "impostor"}, small_model_spec()))
    with pytest.raises(BackendError, match="claims backend 'paged'"):
        manager.cache_write_targets()


def test_repeated_write_target_names_are_refused(registered) -> None:
    class Twice(_Base):
        @plugin_api.hookimpl
        def cache_write_targets(self):
            return [CacheWriteTarget(name="a", buffer=self.buffer)] * 2

    registered("twice", Twice)
    manager = _with_buffers(backend_manager({"full_attention": "twice"}, small_model_spec()))
    with pytest.raises(BackendError, match="names repeat"):
        manager.cache_write_targets()


def test_a_failing_hook_is_reported_with_backend_and_hook_names(registered) -> None:
    class Broken(_Base):
        @plugin_api.hookimpl
        def build_capture_metadata(self, step):
            raise IndexError("boom")

    registered("broken", Broken)
    manager = _with_buffers(backend_manager({"full_attention": "broken"}, small_model_spec()))
    with pytest.raises(BackendError, match=r"'broken'.*build_capture_metadata.*boom"):
        manager.build_capture_metadata(_capture_step())


def test_factory_that_raises_is_reported_with_its_name(registered) -> None:
    class Crashes(_Base):
        def __init__(self, context) -> None:
            raise RuntimeError("no device")

    registered("crashes", Crashes)
    with pytest.raises(BackendError, match=r"'crashes' failed to load: no device"):
        backend_manager({"full_attention": "crashes"}, small_model_spec())


def test_a_layer_backend_without_cache_rows_is_refused_at_load() -> None:
    class NoRows(_Base):
        cache_rows = None

    with pytest.raises(BackendError, match=r"'no-rows' has no cache_rows"):
        register_backend("no-rows", NoRows)


def test_supports_overlap_must_be_a_bool() -> None:
    class Vague(_Base):
        supports_overlap = "yes"

    with pytest.raises(BackendError, match=r"'vague': supports_overlap must be a bool, got 'yes'"):
        register_backend("vague", Vague)
