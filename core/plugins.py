"""Backend discovery, selection and validation, and the typed facade over the hooks.

Backends are discovered from the ``kvrunner.backends`` entry-point group (and from
:func:`register_backend`, for in-process registration). Only the backends the
config selects are constructed and registered on a runner's plugin manager. Every
failure raises :class:`BackendError` naming the backend and the problem.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import attrs
import pluggy
import torch

from kvrunner import hookspecs
from kvrunner.contract import (
    PLUGIN_API_VERSION,
    BackendContext,
    CacheSpec,
    CacheWriteTarget,
    ForwardContext,
    StepBatch,
)
from kvrunner.errors import KvrunnerError

ENTRY_POINT_GROUP = "kvrunner.backends"
#: comma-separated backend names that are never loaded (like PYTEST_DISABLE_PLUGIN_AUTOLOAD)
BLOCK_ENV = "KVRUNNER_BLOCKED_BACKENDS"

BackendFactory = Callable[[BackendContext], Any]
_registered: dict[str, BackendFactory] = {}


class BackendError(KvrunnerError, RuntimeError):
    """A backend could not be found, loaded, validated or called correctly."""


@attrs.frozen
class DiscoveredBackend:
    name: str
    distribution: str
    version: str
    entry_point: EntryPoint | None = None
    factory: BackendFactory | None = None  # set for in-process registrations

    def load(self) -> BackendFactory:
        """Import the factory and check it against this core's plugin contract."""
        try:
            factory = self.factory if self.factory is not None else self.entry_point.load()
        except Exception as e:  # an import error inside a plugin must name the plugin
            raise BackendError(
                f"backend {self.name!r} ({self.distribution}) failed to import: {e!r}"
            ) from e
        _validate_factory(self.name, factory)
        return factory


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make ``factory`` selectable as ``name`` in this process (beside entry points)."""
    _validate_factory(name, factory)
    _registered[name] = factory


def unregister_backend(name: str) -> None:
    _registered.pop(name, None)


def blocked_backends() -> set[str]:
    return {n.strip() for n in os.environ.get(BLOCK_ENV, "").split(",") if n.strip()}


def discover_backends() -> dict[str, DiscoveredBackend]:
    """Every backend installed (entry points) or registered, minus blocked ones."""
    found: dict[str, DiscoveredBackend] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist
        found[ep.name] = DiscoveredBackend(
            name=ep.name,
            distribution=dist.name if dist else "?",
            version=dist.version if dist else "?",
            entry_point=ep,
        )
    for name, factory in _registered.items():
        module = getattr(factory, "__module__", "?")
        found[name] = DiscoveredBackend(
            name=name, distribution=f"<registered: {module}>", version="-", factory=factory
        )
    for name in blocked_backends():
        found.pop(name, None)
    return found


def _validate_factory(name: str, factory: Any) -> None:
    version = getattr(factory, "plugin_api_version", None)
    if version is None:
        raise BackendError(f"backend {name!r} does not declare plugin_api_version")
    if version != PLUGIN_API_VERSION:
        raise BackendError(
            f"backend {name!r} targets plugin API {version}, "
            f"this kvrunner speaks {PLUGIN_API_VERSION}"
        )
    for attr in ("layer_types", "write_targets"):
        value = getattr(factory, attr, None)
        if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
            raise BackendError(f"backend {name!r}: {attr} must be a tuple of str, got {value!r}")
    if not callable(factory):
        raise BackendError(f"backend {name!r}: entry point is not callable")


def _validate_write_targets(
    name: str, declared: tuple[str, ...], targets: Any
) -> list[CacheWriteTarget]:
    if not isinstance(targets, list):
        raise BackendError(f"backend {name!r}: cache_write_targets must return a list")
    for t in targets:
        if not isinstance(t, CacheWriteTarget):
            raise BackendError(f"backend {name!r}: write target {t!r} is not a CacheWriteTarget")
        if t.backend != name:
            raise BackendError(
                f"backend {name!r}: write target {t.name!r} claims backend {t.backend!r}"
            )
        if (
            not isinstance(t.buffer, torch.Tensor)
            or t.buffer.dtype.is_floating_point
            or t.buffer.dtype.is_complex
            or t.buffer.dtype == torch.bool
        ):
            raise BackendError(
                f"backend {name!r}: write target {t.name!r} must be an integer tensor"
            )
        if not isinstance(t.pad_value, int) or isinstance(t.pad_value, bool):
            raise BackendError(
                f"backend {name!r}: write target {t.name!r} has non-integer PAD {t.pad_value!r}"
            )
    names = {t.name for t in targets}
    if names != set(declared):
        raise BackendError(
            f"backend {name!r}: cache_write_targets returned {sorted(names)} "
            f"but the backend declares {sorted(declared)}"
        )
    return targets


class BackendManager:
    """The active backends of one runner and the only caller of their hooks."""

    def __init__(
        self,
        selection: Mapping[str, str],
        context_for: Callable[[str, tuple[str, ...]], BackendContext],
    ) -> None:
        """:param selection: layer type -> backend name, for the layer types the model has.
        :param context_for: builds the context for a backend given the layer types it serves.
        """
        self.pm = pluggy.PluginManager("kvrunner")
        self.pm.add_hookspecs(hookspecs)
        available = discover_backends()
        by_backend: dict[str, list[str]] = {}
        for layer_type, name in selection.items():
            by_backend.setdefault(name, []).append(layer_type)
        self.declared: dict[str, tuple[str, ...]] = {}
        self._subset_callers: dict[str, list[tuple[str, Any]]] = {}
        for name, layer_types in by_backend.items():
            if name not in available:
                blocked = (
                    f" ({name!r} is blocked by {BLOCK_ENV})" if name in blocked_backends() else ""
                )
                raise BackendError(
                    f"backend {name!r} selected for {layer_types} is not installed{blocked}; "
                    f"installed: {sorted(available) or 'none'}"
                )
            factory = available[name].load()
            unsupported = set(layer_types) - set(factory.layer_types)
            if unsupported:
                raise BackendError(
                    f"backend {name!r} cannot serve layer type(s) {sorted(unsupported)}; "
                    f"it serves {list(factory.layer_types)}"
                )
            try:
                instance = factory(context_for(name, tuple(layer_types)))
                self.pm.register(instance, name=name)
            except BackendError:
                raise
            except Exception as e:
                raise BackendError(f"backend {name!r} failed to load: {e}") from e
            self.declared[name] = factory.write_targets
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as e:
            name = self.pm.get_name(e.plugin) or repr(e.plugin)
            problem = str(e).split(" in plugin ")[0]
            raise BackendError(
                f"backend {name!r}: {problem} (no such hook in kvrunner.hookspecs)"
            ) from e

    @property
    def names(self) -> list[str]:
        return [self.pm.get_name(p) for p in self.pm.get_plugins()]

    def _callers(self, hook: str) -> list[tuple[str, Any]]:
        """One single-backend hook caller per backend, built once: this runs every step."""
        cached = self._subset_callers.get(hook)
        if cached is None:
            cached = []
            for name, plugin in self.pm.list_name_plugin():
                others = [p for p in self.pm.get_plugins() if p is not plugin]
                cached.append((name, self.pm.subset_hook_caller(hook, remove_plugins=others)))
            self._subset_callers[hook] = cached
        return cached

    def _call_each(self, hook: str, **kwargs: Any) -> dict[str, Any]:
        """Call ``hook`` on each backend separately (through pluggy, so wrappers and
        tracing still apply); results keyed by backend name, absent where unimplemented."""
        results: dict[str, Any] = {}
        for name, caller in self._callers(hook):
            try:
                answer = caller(**kwargs)
            except BackendError:
                raise
            except Exception as e:
                raise BackendError(f"backend {name!r}: hook {hook} failed: {e!r}") from e
            if answer:
                results[name] = answer[0]
        return results

    def cache_specs(self) -> list[CacheSpec]:
        specs = self._call_each("cache_spec")
        for name, spec in specs.items():
            if not isinstance(spec, CacheSpec):
                raise BackendError(f"backend {name!r}: cache_spec returned {type(spec).__name__}")
        return list(specs.values())

    def allocate_cache(self, *, num_blocks: int, num_slots: int) -> dict[str, torch.Tensor]:
        pools: dict[str, torch.Tensor] = {}
        for name, named in self._call_each(
            "allocate_cache", num_blocks=num_blocks, num_slots=num_slots
        ).items():
            for key, tensor in named.items():
                pools[f"{name}.{key}"] = tensor
        return pools

    def release_cache(self) -> None:
        self._call_each("release_cache")

    def persistent_buffers(self, *, max_batch: int, max_tokens: int) -> dict[str, torch.Tensor]:
        buffers: dict[str, torch.Tensor] = {}
        for name, named in self._call_each(
            "persistent_buffers", max_batch=max_batch, max_tokens=max_tokens
        ).items():
            for key, tensor in named.items():
                buffers[f"{name}.{key}"] = tensor
        return buffers

    def _metadata(self, results: dict[str, Any], hook: str) -> ForwardContext:
        ctx = ForwardContext()
        for name, result in results.items():
            if not (isinstance(result, tuple) and len(result) == 2 and result[0] == name):
                raise BackendError(f"backend {name!r}: {hook} must return ({name!r}, metadata)")
            ctx.metadata[name] = result[1]
        return ctx

    def build_metadata(self, batch: StepBatch) -> ForwardContext:
        return self._metadata(self._call_each("build_metadata", batch=batch), "build_metadata")

    def build_capture_metadata(self, batch_size: int) -> ForwardContext:
        return self._metadata(
            self._call_each("build_capture_metadata", batch_size=batch_size),
            "build_capture_metadata",
        )

    def cache_write_targets(self) -> list[CacheWriteTarget]:
        """The union of every active backend's write targets, validated."""
        union: list[CacheWriteTarget] = []
        results = self._call_each("cache_write_targets")
        for name, declared in self.declared.items():
            union += _validate_write_targets(name, declared, results.get(name, []))
        return union

    def make_layer(self, *, layer_index: int, layer_type: str) -> Any:
        impl = self.pm.hook.make_layer(layer_index=layer_index, layer_type=layer_type)
        if impl is None:
            raise BackendError(f"no active backend made layer {layer_index} ({layer_type})")
        return impl

