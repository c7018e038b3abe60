"""The active backends of one runner, the only caller of their hooks, and their lifecycle.

Each backend is called on its own (a pluggy subset caller), so answers are keyed by
the backend that gave them: a hook never has to say who it is. Any exception
inside a hook is re-raised as :class:`~kvrunner.plugin_api.BackendError` naming the
backend and the hook. The order hooks may be called in (docs/plugins.md,
"Lifecycle") is enforced here, so a core change that breaks it fails loudly
instead of handing a backend a state it never promised to handle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pluggy
import torch

from kvrunner.layers.backend_layer import BackendLayer
from kvrunner.plugin_api import hookspecs
from kvrunner.plugin_api.errors import BackendError, BackendHookError
from kvrunner.plugin_api.factory import (
    CacheRows,
    accepted_kv_cache_dtypes,
    declares_batch_invariance,
    declares_overlap_support,
)
from kvrunner.plugin_api.overlap import OverlapContext
from kvrunner.plugin_api.step_data import (
    BackendContext,
    CacheSpec,
    CacheWriteTarget,
    ForwardContext,
    StepMetadata,
)
from kvrunner.plugin_host.held_tensors import held_tensors
from kvrunner.plugin_host.overlap_manager import OverlapPlugin
from kvrunner.plugin_host.plugins import (
    BLOCK_ENV,
    BackendFactory,
    DiscoveredBackend,
    blocked_backends,
    discover_backends,
    refuse_unmarked_hooks,
    require_hooks,
)
from kvrunner.plugin_host.write_targets import (
    TargetIdentity,
    require_fixed_identity,
    require_fixed_names,
    validate_write_targets,
)

#: hooks that read the persistent buffers, so may only run once they exist
NEEDS_BUFFERS = ("build_metadata", "build_capture_metadata", "cache_write_targets")

#: attribute levels the capture audit walks into a backend for the buffers it holds
#: (``backend.state.parts.builder.slot_mapping`` is four)
HELD_DEPTH = 4

#: ``observer(backend, hook)``, called after each backend's answer to a hook
HookObserver = Callable[[str, str], None]


class BackendManager:
    """The active backends of one runner and the only caller of their hooks."""

    def __init__(
        self,
        selection: Mapping[str, str],
        context_for: Callable[[str, tuple[str, ...]], BackendContext],
        overlap: OverlapContext | None = None,
        core_backends: Mapping[str, BackendFactory] | None = None,
    ) -> None:
        """:param selection: layer type -> backend name, for the layer types the model has.
        :param context_for: builds the context for a backend given the layer types it serves.
        :param overlap: the context of the overlap plugin on top of them, if one is selected.
        :param core_backends: backends the core itself adds, serving no layer type (the
            routed-experts pool: ``runner/routes_backend.py``), by name; held to the
            same contract as an installed one.
        """
        self.pm = pluggy.PluginManager("kvrunner")
        self.pm.add_hookspecs(hookspecs)
        available = discover_backends()
        own = dict(core_backends or {})
        by_backend: dict[str, list[str]] = {}
        for layer_type, name in selection.items():
            if name in own:
                raise BackendError(f"backend name {name!r} (selected for {layer_type!r}) is "
                                   f"the core's own; it serves no layer type")
            by_backend.setdefault(name, []).append(layer_type)
        for name, factory in own.items():  # validated at load, as an entry point's is
            available[name] = DiscoveredBackend(name, "kvrunner", "core", factory=factory)
            by_backend[name] = []
        self._subset_callers: dict[str, list[tuple[str, Any]]] = {}
        #: each backend's write-target names, from its first answer: later answers must match
        self._target_names: dict[str, frozenset[str]] = {}
        #: each write target's tensor, from its first answer: later answers must match
        self._target_identity: dict[str, TargetIdentity] = {}
        #: called after each backend's answer to any hook (the step audit checks the
        #: core's buffers there); None: nothing watches
        self.observer: HookObserver | None = None
        #: each layer backend's ``cache_rows`` (how one slot of its pools is read)
        self.cache_rows: dict[str, CacheRows] = {}
        self._buffer_sizes: tuple[int, int] | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self.allocated = False
        #: layer type -> the backend serving it, and each backend's context
        self.selection = dict(selection)
        self.contexts: dict[str, BackendContext] = {}
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
            if overlap is not None and not declares_overlap_support(factory):
                # The plugin would hand each micro-batch mirrored metadata that the
                # backend's layers never read: wrong tokens, without a word.
                raise BackendError(
                    f"overlap plugin {overlap.name!r} cannot run over backend {name!r}: "
                    f"{name!r} does not declare supports_overlap = True (its layers must "
                    f"read everything but the pools from the metadata it returns; "
                    f"docs/plugins.md, 'Overlap plugins')"
                )
            self.contexts[name] = context_for(name, tuple(layer_types))
            self.cache_rows[name] = factory.cache_rows
            if self.contexts[name].deterministic and not declares_batch_invariance(factory):
                # Its rows would change with the batch: "deterministic" would be a lie.
                raise BackendError(
                    f"deterministic=True cannot run over backend {name!r} (serving "
                    f"{sorted(layer_types)}): {name!r} does not declare batch_invariant = "
                    f"True, so a request's outputs would depend on what shares its steps "
                    f"(docs/plugins.md, 'Batch invariance'); run without deterministic"
                )
            kv_cache_dtype = self.contexts[name].kv_cache_dtype
            if kv_cache_dtype not in accepted_kv_cache_dtypes(factory):
                # It would store its keys and values in the model's dtype: a pool of
                # half the tokens, under a setting that says otherwise.
                raise BackendError(
                    f"kv_cache_dtype={kv_cache_dtype!r} cannot run over backend {name!r} "
                    f"(serving {sorted(layer_types)}): {name!r} accepts "
                    f"{list(accepted_kv_cache_dtypes(factory))} (its kv_cache_dtypes; "
                    f"docs/plugins.md, 'The factory'); choose one of those or another backend"
                )
            try:
                instance = factory(self.contexts[name])
                # A factory function's product is checked here, a class's at load.
                refuse_unmarked_hooks(name, type(instance))
                require_hooks(name, type(instance))
                self.pm.register(instance, name=name)
            except BackendError:
                raise
            except Exception as e:
                raise BackendError(f"backend {name!r} failed to load: {e}") from e
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as e:
            name = self.pm.get_name(e.plugin) or repr(e.plugin)
            problem = str(e).split(" in plugin ")[0]
            raise BackendError(
                f"backend {name!r}: {problem} (no such hook in kvrunner.plugin_api.hookspecs)"
            ) from e
        #: the overlap plugin on top of the layer backends, if the config selects one
        self.overlap = OverlapPlugin(overlap) if overlap is not None else None
        self._layers_view = _LayerBackendsView(self)

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
        if hook in NEEDS_BUFFERS and self._buffer_sizes is None:
            raise BackendError(f"hook {hook} called before persistent_buffers")
        results: dict[str, Any] = {}
        for name, caller in self._callers(hook):
            try:
                answer = caller(**kwargs)
            except BackendError:
                raise
            except Exception as e:
                raise BackendHookError(f"backend {name!r}: hook {hook} failed: {e!r}") from e
            if answer:
                results[name] = answer[0]
            if self.observer is not None:
                self.observer(name, hook)
        return results

    # -- sizing and allocation -------------------------------------------------------

    def cache_specs(self) -> dict[str, CacheSpec]:
        """Each backend's :class:`CacheSpec`, by backend name."""
        specs = self._call_each("cache_spec")
        for name, spec in specs.items():
            if not isinstance(spec, CacheSpec):
                raise BackendError(f"backend {name!r}: cache_spec returned {type(spec).__name__}")
        return specs

    def allocate_cache(self, *, num_blocks: int, num_slots: int) -> dict[str, torch.Tensor]:
        """Every backend's pools as ``"<backend>.<name>"``; refused while allocated."""
        if self.allocated:
            raise BackendError("allocate_cache called twice without release_cache in between")
        pools: dict[str, torch.Tensor] = {}
        specs = self.cache_specs()
        answers = self._call_each("allocate_cache", num_blocks=num_blocks, num_slots=num_slots)
        self.allocated = True
        try:
            for name, named in answers.items():
                require_promised_bytes(name, named, specs.get(name, CacheSpec()),
                                       num_blocks=num_blocks, num_slots=num_slots)
                for key, tensor in named.items():
                    pools[f"{name}.{key}"] = tensor
        except BackendError:
            self.release_cache()  # nothing half-allocated stays behind
            raise
        return pools

    def release_cache(self) -> None:
        """Release every backend's pools; once per allocation (a repeat does nothing)."""
        if self.allocated:
            self._call_each("release_cache")
            self.allocated = False

    # -- forward_vars and metadata ---------------------------------------------------

    def persistent_buffers(self, *, max_batch: int, max_tokens: int) -> dict[str, torch.Tensor]:
        """The backends' buffers as ``"<backend>.<name>"``, created once.

        A repeated call with the same sizes returns the same tensors; other sizes are
        refused, since captured graphs may already read the first ones by address.
        """
        if self._buffer_sizes is not None:
            if self._buffer_sizes != (max_batch, max_tokens):
                raise BackendError(
                    f"persistent buffers already exist for {self._buffer_sizes}; refusing "
                    f"to reallocate them for {(max_batch, max_tokens)} under captured graphs"
                )
            return dict(self._buffers)
        for name, named in self._call_each(
            "persistent_buffers", max_batch=max_batch, max_tokens=max_tokens
        ).items():
            for key, tensor in named.items():
                self._buffers[f"{name}.{key}"] = tensor
        self._buffer_sizes = (max_batch, max_tokens)
        if self.overlap is not None:
            self._buffers.update(self.overlap.buffers(
                self.layer_write_targets(), max_batch=max_batch, max_tokens=max_tokens
            ))
        return dict(self._buffers)

    def _context(self, results: dict[str, Any], hook: str) -> ForwardContext:
        for name in self.names:
            if results.get(name) is None:
                raise BackendError(f"backend {name!r}: {hook} returned no metadata")
        return ForwardContext(metadata=results)

    def build_metadata(self, step: StepMetadata) -> ForwardContext:
        """Every backend's metadata for a real step, keyed by backend name; or the
        overlap plugin's micro-batches, each with its own."""
        return self._split_or_whole(step, "build_metadata")

    def build_capture_metadata(self, step: StepMetadata) -> ForwardContext:
        """Every backend's metadata for a capture whose read side the core synthesized."""
        if not step.is_capture:
            raise BackendError("build_capture_metadata needs the core's capture step")
        return self._split_or_whole(step, "build_capture_metadata")

    def _split_or_whole(self, step: StepMetadata, hook: str) -> ForwardContext:
        if self.overlap is not None and self._buffer_sizes is not None:
            parts = self.overlap.plan(step, self._layers_view)
            if parts is not None:
                return ForwardContext(micro_batches=parts)
        return self._context(self._call_each(hook, step=step), hook)

    def build_layer_metadata(self, step: StepMetadata) -> ForwardContext:
        """The layer backends' metadata for ``step`` (capture or real), never split."""
        hook = "build_capture_metadata" if step.is_capture else "build_metadata"
        return self._context(self._call_each(hook, step=step), hook)

    def cache_write_targets(self) -> list[CacheWriteTarget]:
        """The union of every active backend's write targets (the overlap plugin's
        mirrors included), validated and owned."""
        targets = self.layer_write_targets()
        if self.overlap is not None:
            targets += self.overlap.write_targets()
            require_fixed_identity(
                [t for t in targets if t.backend == self.overlap.name], self._target_identity
            )
        return targets

    def layer_write_targets(self) -> list[CacheWriteTarget]:
        """The layer backends' write targets, validated and owned."""
        union: list[CacheWriteTarget] = []
        results = self._call_each("cache_write_targets")
        for name in self.names:
            targets = validate_write_targets(name, results.get(name, []))
            require_fixed_names(name, targets, self._target_names)
            require_fixed_identity(targets, self._target_identity)
            union += targets
        return union

    def held_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the layer backends hold within :data:`HELD_DEPTH` attribute levels
        (``"<backend>.builder.slot_mapping"``): their builders' buffers, whether in
        forward_vars or not, and their pools. The capture audit seeds the integer
        ones that are neither a declared write target nor a pool."""
        return {
            f"{name}.{path}": tensor
            for name, plugin in self.pm.list_name_plugin()
            for path, tensor in held_tensors(plugin, depth=HELD_DEPTH).items()
        }

    # -- layers ----------------------------------------------------------------------

    def make_layer(self, *, layer_index: int, layer_type: str) -> BackendLayer:
        """The object serving one model layer, asked of the backend selected for its type
        only (a backend never has to filter layers it does not serve)."""
        name = self.selection.get(layer_type)
        if name is None or layer_index not in self.contexts[name].layers:
            raise BackendError(f"no active backend serves layer {layer_index} ({layer_type})")
        (caller,) = [c for n, c in self._callers("make_layer") if n == name]
        try:
            answer = caller(layer_index=layer_index, layer_type=layer_type)
        except Exception as e:
            raise BackendHookError(f"backend {name!r}: hook make_layer failed: {e!r}") from e
        if not answer or answer[0] is None:
            raise BackendError(f"backend {name!r} made no layer {layer_index} ({layer_type})")
        return BackendLayer(answer[0], backend=name, layer_index=layer_index, layer_type=layer_type)


class _LayerBackendsView:
    """The layer backends as an overlap plugin may call them (LayerBackends)."""

    def __init__(self, manager: BackendManager) -> None:
        self._manager = manager

    def build(self, step: StepMetadata) -> ForwardContext:
        return self._manager.build_layer_metadata(step)

    def write_targets(self) -> list[CacheWriteTarget]:
        return self._manager.layer_write_targets()


def require_promised_bytes(
    name: str, pools: Mapping[str, torch.Tensor], spec: CacheSpec, *, num_blocks: int,
    num_slots: int,
) -> None:
    """Refuse pools whose bytes differ from what ``name``'s :class:`CacheSpec` promised
    for ``num_blocks`` blocks and ``num_slots`` slots: the pool was sized from the
    promise, so a backend that takes more runs the device out of memory, one that
    takes less wastes it, and either way the sizing is a lie. Storage shared by two
    pools (keys and values as views of one tensor) counts once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in pools.values()}
    allocated = sum(storages.values())
    promised = spec.bytes_per_block * num_blocks + spec.bytes_per_slot * num_slots
    if allocated != promised:
        raise BackendError(
            f"backend {name!r}: allocate_cache({num_blocks} blocks, {num_slots} slots) took "
            f"{allocated} bytes, but its cache_spec promised {promised} "
            f"({spec.bytes_per_block} per block, {spec.bytes_per_slot} per slot): the pools "
            f"are sized from cache_spec, so it must state the bytes allocate_cache allocates"
        )
