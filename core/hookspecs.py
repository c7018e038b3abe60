"""Hook specifications: the contract between the kvrunner core and a cache backend.

A backend is an object registered on a runner's :class:`pluggy.PluginManager` (one
instance per selected backend, built from its entry point in the
``kvrunner.backends`` group with a :class:`~kvrunner.contract.BackendContext`). It
implements the hooks below with ``@kvrunner.hookimpl``; unimplemented hooks are
simply not called on it.

Hooks are always called with keyword arguments (pluggy refuses positional ones) and
the core never calls ``pm.hook.*`` directly: :class:`kvrunner.plugins.BackendManager`
is the typed facade. Collecting hooks return one result per backend; ``firstresult``
hooks stop at the first backend that answers with something other than ``None``.

Sections: sizing, allocation, forward_vars, metadata, capture safety, layers.
"""

from __future__ import annotations

from typing import Any

import pluggy
import torch

from kvrunner.contract import CacheSpec, CacheWriteTarget, StepBatch

hookspec = pluggy.HookspecMarker("kvrunner")
hookimpl = pluggy.HookimplMarker("kvrunner")

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
    """Drop every reference to the pools made by :func:`allocate_cache`."""


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
def build_metadata(batch: StepBatch) -> tuple[str, Any]:
    """Fill this backend's buffers for a real batch and return ``(name, metadata)``.

    Prefill, decode and mixed batches all come through here. Rows past
    ``batch.num_seqs`` / ``batch.num_tokens`` (the padded tail a graph replays) must
    hold the PAD value in every write target.
    """


@hookspec
def build_capture_metadata(batch_size: int) -> tuple[str, Any]:
    """Return ``(name, metadata)`` for capturing a decode graph of ``batch_size`` rows.

    Synthesize the *read* side (indptr, indices, lengths) so kernels stay in bounds.
    Do not touch the write side: the core has already blanked every declared write
    target to its PAD value before calling this.
    """


# ---------------------------------------------------------------------------
# capture safety
# ---------------------------------------------------------------------------


@hookspec
def cache_write_targets() -> list[CacheWriteTarget]:
    """Return every buffer through which this backend's kernels write cache or state.

    Include buffers that live on the backend's builder and not in forward_vars. The
    core blanks the union over all active backends to each target's PAD value
    before every capture; a write through an undeclared buffer is caught by the
    capture audit.
    """


# ---------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def make_layer(layer_index: int, layer_type: str) -> Any | None:
    """Return the attention/state implementation for one model layer, or ``None``.

    The backend the config selected for ``layer_type`` answers for the layers it
    serves; every other backend returns ``None``. The returned object exposes
    ``forward(...)`` as the model's layer type expects (see
    :mod:`kvrunner.layers.attention`) and reads its per-step metadata from the
    :class:`~kvrunner.contract.ForwardContext` passed to it.
    """
