"""Hook specifications: the contract between the kvrunner core and a cache backend.

A backend is an object registered on a runner's :class:`pluggy.PluginManager` (one
instance per selected backend, built from its entry point in the
``kvrunner.backends`` group with a :class:`~kvrunner.plugin_api.step_data.BackendContext`). It
implements the hooks below with ``@kvrunner.plugin_api.hookimpl``; unimplemented hooks are
simply not called on it.

Hooks are always called with keyword arguments (pluggy refuses positional ones) and
the core never calls ``pm.hook.*`` directly:
:class:`kvrunner.plugin_host.backend_manager.BackendManager` is the typed facade. It
calls each backend on its own and keys the answers by backend name, so no answer
carries the name.

Lifecycle (enforced by the manager, documented in docs/plugins.md): construction;
``make_layer`` per layer while the model loads; ``persistent_buffers`` once;
``cache_spec``; ``allocate_cache``; then any number of steps (``build_metadata``)
and captures (``cache_write_targets``, then ``build_capture_metadata``);
``release_cache`` and ``allocate_cache`` again, in pairs, around each sleep.

Sections: sizing, allocation, forward_vars, metadata, capture safety, layers, and
overlap (hooks only an overlap plugin such as ``tbo`` implements: it serves no
layer type and sits on top of the layer backends).
"""

from __future__ import annotations

from typing import Any

import pluggy
import torch

from kvrunner.plugin_api.overlap import LayerBackends, LayerStack, MicroBatch
from kvrunner.plugin_api.step_data import CacheSpec, CacheWriteTarget, StepMetadata

hookspec = pluggy.HookspecMarker("kvrunner")
hookimpl = pluggy.HookimplMarker("kvrunner")

#: hooks every layer backend implements: without them the core has no layer to call
#: and no metadata to hand it (a missing one fails at its first use, naming the backend)
REQUIRED_OF_LAYER_BACKENDS = frozenset({"make_layer", "build_metadata", "build_capture_metadata"})
#: hooks required of a backend that implements another: hook -> the one that makes it
#: required (refused at load without it)
REQUIRED_WITH = {"release_cache": "allocate_cache"}
#: hooks every overlap plugin implements (the rest of the "overlap" section is optional)
REQUIRED_OF_OVERLAP_PLUGINS = frozenset({"plan_micro_batches", "forward_micro_batches"})

# ---------------------------------------------------------------------------
# sizing
# ---------------------------------------------------------------------------


@hookspec
def cache_spec() -> CacheSpec:
    """Return the bytes this backend needs per KV block and per request slot.

    Summed over every layer the backend serves. The runner adds the specs of all
    active backends and divides the memory budget by them, so the block count it
    derives fits every backend's pools at once.
    """


# ---------------------------------------------------------------------------
# allocation
# ---------------------------------------------------------------------------


@hookspec
def allocate_cache(num_blocks: int, num_slots: int) -> dict[str, torch.Tensor]:
    """Allocate this backend's cache/state pools and return them by name.

    :param num_blocks: KV blocks agreed by the runner (never re-derived later).
    :param num_slots: request slots for per-request state (``max_num_seqs`` + 1;
        slot ``num_slots - 1`` is reserved as a scratch slot that no request owns).

    The returned pools are what the capture audit snapshots and compares, so return
    every tensor the kernels write as cache or state.
    """


@hookspec
def release_cache() -> None:
    """Drop every reference to the pools made by :func:`allocate_cache`.

    Called once per allocation (sleep, or the end of the sizing profile); the next
    :func:`allocate_cache` comes with the same counts. Persistent buffers and layer
    objects stay: a layer must look its pool up again on its next forward. Required
    of every backend that implements :func:`allocate_cache`; after a sleep the core
    checks that every pool's storage is gone and fails the sleep naming the backend
    if one is still alive.
    """


# ---------------------------------------------------------------------------
# forward_vars
# ---------------------------------------------------------------------------


@hookspec
def persistent_buffers(max_batch: int, max_tokens: int) -> dict[str, torch.Tensor]:
    """Return the persistent device buffers this backend adds to forward_vars.

    Created once, at their largest size, and never reallocated: captured graphs
    read them by address. The runner registers each as ``"<backend>.<name>"``.
    """


# ---------------------------------------------------------------------------
# metadata
# ---------------------------------------------------------------------------


@hookspec
def build_metadata(step: StepMetadata) -> Any:
    """Fill this backend's own buffers for a real step and return its metadata.

    ``step`` carries the shared read side the core already placed on the device
    (query start offsets, context lengths, block tables, positions) and the host
    batch (``step.host``); the backend adds only what its kernels need beyond that
    and fills its write targets. Prefill, decode and mixed steps all come here. Rows
    past ``step.num_seqs`` / ``step.num_tokens`` (the padded tail a graph replays)
    must hold the PAD value in every write target. The returned object is what the
    layers read with ``ctx.for_backend(name)``; when a graph replays, the object
    built at capture is used instead, so anything a replay depends on must live in a
    buffer.
    """


@hookspec
def build_capture_metadata(step: StepMetadata) -> Any:
    """Return this backend's metadata for capturing a decode graph of ``step.num_seqs`` rows.

    ``step`` is the core's synthesized capture step (every row one token reading one
    key at block 0). Derive only the backend's own *read* side from it. Do not touch
    the write side: the core has blanked every declared write target to its PAD
    value just before.
    """


# ---------------------------------------------------------------------------
# capture safety
# ---------------------------------------------------------------------------


@hookspec
def cache_write_targets() -> list[CacheWriteTarget]:
    """Return every buffer through which this backend's kernels write cache or state.

    This is the one declaration of the backend's write targets: the names must be
    the same at every call. Include buffers that live on the backend's builder and
    not in forward_vars. The core blanks the union over all active backends to each
    target's PAD value before every capture; a write through an undeclared buffer is
    caught by the capture audit, which seeds the integer tensors it finds on the
    backend object and its attributes (its builder) as it seeds forward_vars.
    """


# ---------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------


@hookspec
def make_layer(layer_index: int, layer_type: str) -> Any:
    """Return the attention/state implementation for one model layer.

    Called once per layer while the model loads, before ``persistent_buffers``, and
    only on the backend the config selected for ``layer_type``, for a layer in its
    ``context.layers``: a backend never filters. The returned object
    implements the protocol of its layer type (:mod:`kvrunner.plugin_api.layers`:
    ``FullAttentionImpl``, ``LinearAttentionImpl``) and reads its per-step metadata
    from the :class:`~kvrunner.plugin_api.step_data.ForwardContext` passed to it. The core wraps
    it so an exception in its ``forward`` names the backend and the layer.
    """


# ---------------------------------------------------------------------------
# overlap (an overlap plugin only; called after every layer backend's hook)
# ---------------------------------------------------------------------------


@hookspec
def overlap_buffers(
    layer_write_targets: list[CacheWriteTarget], max_batch: int, max_tokens: int
) -> dict[str, torch.Tensor]:
    """Create the plugin's persistent buffers once; return them by name.

    Called after every layer backend's ``persistent_buffers``, with their declared
    write targets, so per-micro-batch mirrors of those targets can be made now,
    before any capture. The core registers each buffer in forward_vars as
    ``"<plugin>.<name>"`` (where the capture audit seeds the undeclared ones).
    """


@hookspec
def plan_micro_batches(step: StepMetadata, layers: LayerBackends) -> tuple[MicroBatch, ...] | None:
    """Cut ``step`` into micro-batches, or return ``None`` to run it whole.

    For every part, build the layer backends' metadata (``layers.build``) and keep
    it in the plugin's own persistent buffers. A capture step (``step.is_capture``)
    comes here too, and must be cut exactly as a real decode step of
    ``step.num_padded_seqs`` rows is, since the graph replays with the real step's
    buffers; there the write side of every mirror must be left as the core blanked
    it. Whatever a replay reads must live in a buffer.
    """


@hookspec
def forward_micro_batches(
    stack: LayerStack, micro_batches: tuple[MicroBatch, ...], input_ids: torch.Tensor
) -> torch.Tensor:
    """Run the model over the parts; the final hidden states of every token row, in
    the step's order (``[len(input_ids), hidden]``).

    Layer ``i`` of a part must not start before layer ``i`` of the parts before it
    has written its cache and state: a sequence cut in two reads, in its second
    part, what its first part wrote. Runs inside graph capture too.
    """
