"""Backend discovery and the checks a backend's factory passes at load.

Backends are discovered from the ``kvrunner.backends`` entry-point group (and from
:func:`register_backend`, for in-process registration). Only the backends the
config selects are constructed and registered on a runner's plugin manager
(:class:`kvrunner.plugin_host.backend_manager.BackendManager`, the typed facade over the hooks).
Every failure raises :class:`~kvrunner.plugin_api.BackendError` naming the backend
and the problem.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import attrs

from kvrunner.plugin_api import hookspecs
from kvrunner.plugin_api.errors import BackendError
from kvrunner.plugin_api.step_data import PLUGIN_API_VERSION, BackendContext

ENTRY_POINT_GROUP = "kvrunner.backends"
#: comma-separated backend names that are never loaded (like PYTEST_DISABLE_PLUGIN_AUTOLOAD)
BLOCK_ENV = "KVRUNNER_BLOCKED_BACKENDS"

BackendFactory = Callable[[BackendContext], Any]
_registered: dict[str, BackendFactory] = {}


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
    """Make ``factory`` selectable as ``name`` in this process, beside entry points.

    For backends that are not installed as a distribution (a notebook, a test). The
    factory is validated now, exactly as an entry point's is at load; a registered
    name shadows an installed backend of the same name until
    :func:`unregister_backend`.
    """
    _validate_factory(name, factory)
    _registered[name] = factory


def unregister_backend(name: str) -> None:
    """Forget a :func:`register_backend` registration (no error if there is none)."""
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


def hook_names() -> frozenset[str]:
    """Every hook name in :mod:`kvrunner.plugin_api.hookspecs`."""
    return frozenset(
        name
        for name, fn in vars(hookspecs).items()
        if inspect.isfunction(fn) and hasattr(fn, "kvrunner_spec")
    )


def _validate_factory(name: str, factory: Any) -> None:
    version = getattr(factory, "plugin_api_version", None)
    if version is None:
        raise BackendError(f"backend {name!r} does not declare plugin_api_version")
    if version != PLUGIN_API_VERSION:
        raise BackendError(
            f"backend {name!r} targets plugin API {version}, "
            f"this kvrunner speaks {PLUGIN_API_VERSION}"
        )
    layer_types = getattr(factory, "layer_types", None)
    if not isinstance(layer_types, tuple) or not all(isinstance(v, str) for v in layer_types):
        raise BackendError(
            f"backend {name!r}: layer_types must be a tuple of str, got {layer_types!r}"
        )
    if not callable(factory):
        raise BackendError(f"backend {name!r}: entry point is not callable")
    overlap = getattr(factory, "supports_overlap", False)
    if not isinstance(overlap, bool):
        raise BackendError(f"backend {name!r}: supports_overlap must be a bool, got {overlap!r}")
    invariant = getattr(factory, "batch_invariant", False)
    if not isinstance(invariant, bool):
        raise BackendError(f"backend {name!r}: batch_invariant must be a bool, got {invariant!r}")
    kv_dtypes = getattr(factory, "kv_cache_dtypes", ("auto",))
    if not isinstance(kv_dtypes, tuple) or not all(isinstance(v, str) for v in kv_dtypes):
        raise BackendError(
            f"backend {name!r}: kv_cache_dtypes must be a tuple of str, got {kv_dtypes!r}"
        )
    if layer_types and not callable(getattr(factory, "cache_rows", None)):
        # Required of every layer backend: without it the conformance kit cannot read
        # a slot of its pools, so nothing can show the backend keeps the contract.
        raise BackendError(
            f"backend {name!r} has no cache_rows(pool_name, pool) attribute: every layer "
            f"backend declares how one slot of its pools is read (docs/plugins.md, "
            f"'The factory')"
        )
    if isinstance(factory, type):
        refuse_unmarked_hooks(name, factory)
        require_hooks(name, factory)


def _implements(cls: type, hook: str) -> bool:
    method = inspect.getattr_static(cls, hook, None)
    function = getattr(method, "__func__", method)
    return callable(function) and hasattr(function, "kvrunner_impl")


#: why each hook of :data:`~kvrunner.plugin_api.hookspecs.REQUIRED_WITH` is required
_WHY_REQUIRED_WITH = {
    "release_cache": "every backend that allocates must release its pools, or a sleep "
                     "frees nothing",
    "cache_spec": "the pools are sized from cache_spec, and allocate_cache must take "
                  "exactly the bytes it promises",
    "build_capture_metadata": "every step a captured graph replays was built by it, and "
                              "the first capture needs its answer (enforce_eager or not)",
}


def require_hooks(name: str, cls: type) -> None:
    """Refuse at load a backend that implements a hook and leaves out one the contract
    requires beside it (:data:`~kvrunner.plugin_api.hookspecs.REQUIRED_WITH`): found
    at its first use instead, a missing ``build_capture_metadata`` would pass every
    eager run and fail the first capture as "returned no metadata"."""
    for hook, because in hookspecs.REQUIRED_WITH.items():
        if _implements(cls, because) and not _implements(cls, hook):
            raise BackendError(
                f"backend {name!r} implements {because} but not {hook}: "
                f"{_WHY_REQUIRED_WITH[hook]}"
            )


def refuse_unmarked_hooks(name: str, cls: type) -> None:
    """A method named like a hook but without ``@hookimpl`` is never called: pluggy
    ignores it, and the mistake shows up far from its cause (a capture with no
    metadata). Refuse it at load instead."""
    for hook in sorted(hook_names()):
        method = inspect.getattr_static(cls, hook, None)
        if method is None:
            continue
        function = getattr(method, "__func__", method)
        if callable(function) and not hasattr(function, "kvrunner_impl"):
            raise BackendError(
                f"backend {name!r}: method {hook} is named like a hook but has no "
                f"@kvrunner.plugin_api.hookimpl, so it would never be called"
            )


__all__ = [
    "BLOCK_ENV",
    "ENTRY_POINT_GROUP",
    "DiscoveredBackend",
    "discover_backends",
    "hook_names",
    "refuse_unmarked_hooks",
    "require_hooks",
    "register_backend",
    "unregister_backend",
]
