"""The plugin API: everything a backend plugin may import from kvrunner.

A backend (a layer backend such as ``paged`` or ``gdn``, or an overlap plugin such
as ``tbo``) imports from this package and from nowhere else in kvrunner; a test
checks every backend in the tree. What is exported here is versioned by
:data:`PLUGIN_API_VERSION`: a backend declares the version it was written against
and a mismatch is refused at load.

- the hooks: :mod:`~kvrunner.plugin_api.hookspecs` and the :data:`hookimpl` marker;
- what a factory declares (``layer_types``, ``cache_rows``, ``supports_overlap``,
  ``batch_invariant``, ``kv_cache_dtypes``):
  :mod:`~kvrunner.plugin_api.factory`;
- the data a hook is handed or answers with: :mod:`~kvrunner.plugin_api.step_data`;
- the data an overlap plugin is handed: :mod:`~kvrunner.plugin_api.overlap`, and what
  it requires of a layer backend's metadata: :mod:`~kvrunner.plugin_api.mirroring`;
- what a model layer expects from the object ``make_layer`` returns:
  :mod:`~kvrunner.plugin_api.layers`;
- in-place buffer fills a metadata builder may use: :mod:`~kvrunner.plugin_api.buffers`;
- the errors a backend raises or is reported with: :mod:`~kvrunner.plugin_api.errors`.

docs/plugins.md is the guide to all of it.
"""

from kvrunner.plugin_api import hookspecs
from kvrunner.plugin_api.buffers import fill_head, on_device
from kvrunner.plugin_api.errors import BackendError, BackendHookError, KvrunnerError
from kvrunner.plugin_api.factory import (
    CacheRows,
    LayerBackendFactory,
    accepted_kv_cache_dtypes,
    declares_batch_invariance,
    declares_overlap_support,
)
from kvrunner.plugin_api.hookspecs import hookimpl
from kvrunner.plugin_api.layers import FullAttentionImpl, LinearAttentionImpl
from kvrunner.plugin_api.mirroring import TensorMap, map_tensors, unwalked_tensors
from kvrunner.plugin_api.overlap import (
    DecoderLayer,
    LayerBackends,
    LayerStack,
    MicroBatch,
    OverlapContext,
)
from kvrunner.plugin_api.step_data import (
    PAD_SLOT_ID,
    PLUGIN_API_VERSION,
    BackendContext,
    CacheSpec,
    CacheWriteTarget,
    ForwardContext,
    ModelSpec,
    StepBatch,
    StepMetadata,
)

__all__ = [
    "PAD_SLOT_ID",
    "PLUGIN_API_VERSION",
    "BackendContext",
    "BackendError",
    "BackendHookError",
    "CacheRows",
    "CacheSpec",
    "CacheWriteTarget",
    "DecoderLayer",
    "ForwardContext",
    "FullAttentionImpl",
    "KvrunnerError",
    "LayerBackendFactory",
    "LayerBackends",
    "LayerStack",
    "LinearAttentionImpl",
    "MicroBatch",
    "ModelSpec",
    "OverlapContext",
    "StepBatch",
    "StepMetadata",
    "TensorMap",
    "accepted_kv_cache_dtypes",
    "declares_batch_invariance",
    "declares_overlap_support",
    "fill_head",
    "hookimpl",
    "hookspecs",
    "map_tensors",
    "on_device",
    "unwalked_tensors",
]
