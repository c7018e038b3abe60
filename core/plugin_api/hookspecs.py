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
``cache_spec``; on CUDA the start-up profile's ``allocate_cache`` of a minimal pool
and its ``release_cache``; ``allocate_cache`` at the agreed counts; then any number
of steps (``build_metadata``) and captures (``cache_write_targets``, then
``build_capture_metadata``); ``release_cache`` and ``allocate_cache`` again, at the
agreed counts, in pairs around each sleep.

Each hook's docstring is the one statement of its rules: docs/plugins.md's hook
sections are rendered from them (``python tests/core/hook_docs.py --write``).

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
REQUIRED_OF_LAYER_BACKENDS = frozenset({"make_layer", "build_metadata"})
#: hooks required of a backend that implements another: hook -> the one that makes it
#: required (refused at load without it)
REQUIRED_WITH = {
    "release_cache": "allocate_cache",
    "cache_spec": "allocate_cache",
    "build_capture_metadata": "build_metadata",
}
#: hooks every overlap plugin implements (the rest of the "overlap" section is optional)
REQUIRED_OF_OVERLAP_PLUGINS = frozenset({"plan_micro_batches", "forward_micro_batches"})

# ---------------------------------------------------------------------------
# sizing
# ---------------------------------------------------------------------------


@hookspec
def cache_spec() -> CacheSpec:
    """Return the bytes this backend needs per KV block and per request slot.

    Summed over every layer the backend serves. The runner sums the specs of all active
    backends and divides the memory budget by them, after setting aside
    ``bytes_per_slot * num_slots``, so the block count it derives fits every backend's
    pools at once. Asked when sizing and whenever the pools' size is reported.
    Required of a backend that implements :func:`allocate_cache`, whose pools must take
    exactly ``bytes_per_block * num_blocks + bytes_per_slot * num_slots`` bytes (storage
    shared by two pools counted once): the core refuses any other allocation at load,
    and releases it.
    """


# ---------------------------------------------------------------------------
# allocation
# ---------------------------------------------------------------------------


@hookspec
def allocate_cache(num_blocks: int, num_slots: int) -> dict[str, torch.Tensor]:
    """Allocate this backend's cache/state pools and return them by name.

    The runner prefixes each name with the backend's. Return every tensor the kernels
    write as cache or state: these are what the capture and step audits snapshot and
    compare, and they take exactly the bytes :func:`cache_spec` promised.

    :param num_blocks: KV blocks. After start-up, always the group's agreed count (the
        engine's block manager and every rank hold exactly it): never derive another.
        The one other count is the start-up profile's on CUDA, a minimal pool released
        before the pool is sized.
    :param num_slots: request slots for per-request state (``max_num_seqs`` + 1; slot
        ``num_slots - 1`` is a scratch slot that no request owns).
    """


@hookspec
def release_cache() -> None:
    """Drop every reference to the pools made by :func:`allocate_cache`.

    Called once per allocation: at a sleep, and at the end of the start-up profile on
    CUDA. The next :func:`allocate_cache` comes with the agreed counts. Persistent
    buffers and layer objects stay: a layer must look its pool up again on its next
    forward. Required of every backend that implements :func:`allocate_cache` (one
    without it is refused at load). After each sleep the core checks that the storage
    of every pool the backend returned is gone; one still alive fails the sleep with a
    ``BackendError`` naming the backend, and the sleep reports only the bytes actually
    freed.
    """


# ---------------------------------------------------------------------------
# forward_vars
# ---------------------------------------------------------------------------


@hookspec
def persistent_buffers(max_batch: int, max_tokens: int) -> dict[str, torch.Tensor]:
    """Return the persistent device buffers this backend adds to forward_vars.

    The runner registers each as ``"<backend>.<name>"``. Created once, at their largest
    size: captured graphs read them by address, so never reallocate them, write into
    them. Buffers a backend keeps elsewhere (on its builder) are fine too, but a write
    target among them must still be declared (:func:`cache_write_targets`). Never write
    into the core's own step buffers (``positions``, the shared read side): other layers
    read them.
    """


# ---------------------------------------------------------------------------
# metadata
# ---------------------------------------------------------------------------


@hookspec
def build_metadata(step: StepMetadata) -> Any:
    """Fill this backend's own buffers for a real step and return its metadata.

    ``step`` carries the shared read side the core already placed on the device (query
    start offsets, context lengths, block tables, positions) and the host batch
    (``step.host``, a ``StepBatch``); the backend adds only what its kernels need beyond
    that and fills its write targets. Prefill, decode and mixed steps all come here.
    Rows past ``step.num_seqs`` / ``step.num_tokens`` up to ``step.num_padded_seqs`` /
    ``step.num_padded_tokens`` are the padded tail a graph replays: they must hold the
    PAD value in every write target the step fills. The returned object is what the
    layers read with ``ctx.for_backend(name, Type)``; when a graph replays, the object
    built at capture is used instead, so anything a replay depends on must live in a
    buffer.
    """


@hookspec
def build_capture_metadata(step: StepMetadata) -> Any:
    """Return this backend's metadata for capturing a decode graph of ``step.num_seqs`` rows.

    ``step`` is the core's synthesized capture step (``step.is_capture``): every row one
    token at position 0 reading one key at block 0, so kernels stay in bounds. Derive
    only the backend's own *read* side from it. Do not touch the write side: the core
    blanked every declared write target to its PAD value just before.
    """


# ---------------------------------------------------------------------------
# capture safety
# ---------------------------------------------------------------------------


@hookspec
def cache_write_targets() -> list[CacheWriteTarget]:
    """Return every buffer through which this backend's kernels write cache or state.

    The one declaration of the backend's write targets, each with its PAD value:
    integer tensors, integer PAD, unique names, the same names at every call. Include
    buffers that live on the backend's own builder, not in forward_vars: the core blanks
    them all the same. The core blanks the union over all active backends before every
    capture; a write through an undeclared buffer is caught by the capture audit, which
    seeds the integer tensors it finds on the backend object and its attributes (its
    builder) as it seeds forward_vars.
    """


# ---------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------


@hookspec
def make_layer(layer_index: int, layer_type: str) -> Any:
    """Return the attention/state implementation for one model layer.

    Called once per layer while the model loads, before ``persistent_buffers``, and only
    on the backend the config selected for ``layer_type``, for a layer in its
    ``context.layers``: a backend never filters. The returned object implements the
    protocol of its layer type (:mod:`kvrunner.plugin_api.layers`: full attention
    ``FullAttentionImpl``, linear attention ``LinearAttentionImpl``) and reads its
    per-step metadata from the ``ForwardContext`` passed to it. The core wraps it
    (``BackendLayer``): attribute reads pass through, and an exception in its
    ``forward`` is re-raised as ``BackendLayerError`` naming the backend and the layer,
    with the original chained.
    """


# ---------------------------------------------------------------------------
# overlap (an overlap plugin only; called after every layer backend's hook)
# ---------------------------------------------------------------------------


@hookspec
def overlap_buffers(
    layer_write_targets: list[CacheWriteTarget], max_batch: int, max_tokens: int
) -> dict[str, torch.Tensor]:
    """Create the plugin's persistent buffers once; return them by name.

    Called once, after every layer backend's ``persistent_buffers``, with their declared
    write targets, so per-micro-batch mirrors of those targets can be made now, before
    any capture. The core registers each buffer in forward_vars as ``"<plugin>.<name>"``
    (where the capture audit seeds the undeclared ones). The plugin's
    :func:`cache_write_targets` then declares its mirrors, and the core blanks them with
    the rest.
    """


@hookspec
def plan_micro_batches(step: StepMetadata, layers: LayerBackends) -> tuple[MicroBatch, ...] | None:
    """Cut ``step`` into micro-batches, or return ``None`` to run it whole.

    Called for every real and every capture step. The parts must cover the step's token
    rows (padded ones included) exactly once, in order: the core checks, and raises
    ``BackendError`` naming the plugin. For every part, ``layers.build(part)`` runs
    every layer backend's ``build_metadata`` (``build_capture_metadata`` for a capture
    part) and overwrites their buffers, so what each part keeps must be copied into the
    plugin's own persistent buffers. A capture step (``step.is_capture``) must be cut
    exactly as a real decode step of ``step.num_padded_seqs`` rows is, since the graph
    replays with the real step's buffers; there the write side of every mirror stays as
    the core blanked it. Whatever a replay reads must live in a buffer.
    """


@hookspec
def forward_micro_batches(
    stack: LayerStack, micro_batches: tuple[MicroBatch, ...], input_ids: torch.Tensor
) -> torch.Tensor:
    """Run the model over the parts; the final hidden states of every token row, in the
    step's order (``[len(input_ids), hidden]``).

    Layer ``i`` of a part must not start before layer ``i`` of the parts before it has
    written its cache and state: a sequence cut in two reads, in its second part, what
    its first part wrote. Runs inside graph capture too.
    """
