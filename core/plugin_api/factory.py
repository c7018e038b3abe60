"""What a backend's factory declares: the attributes the core reads before calling it.

The entry point of a backend names its factory (a class, usually): called with a
:class:`~kvrunner.plugin_api.step_data.BackendContext`, it returns the object whose
hooks the core calls. These attributes on the factory are checked at load, before
any is called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from kvrunner.plugin_api.step_data import BackendContext

#: ``cache_rows(pool_name, pool) -> (kind, rows)``: ``rows[i]`` is everything the pool
#: ``pool_name`` (without the backend's prefix) holds for KV slot ``i`` (kind ``"kv"``,
#: slot ``block * block_size + offset``) or for request slot ``i`` (kind ``"state"``);
#: a view or a copy, only read
CacheRows = Callable[[str, torch.Tensor], tuple[str, torch.Tensor]]


class LayerBackendFactory(Protocol):
    """The factory of a layer backend (``paged``, ``gdn``)."""

    #: the plugin API version it was written against; must equal ``PLUGIN_API_VERSION``
    plugin_api_version: int
    #: the layer types it can serve (``"full_attention"``, ``"linear_attention"``)
    layer_types: tuple[str, ...]
    #: how the conformance kit reads one slot of each pool it allocates. Required: a
    #: backend the kit cannot read cannot be shown to keep the contract, and the core
    #: refuses a layer backend without it at load.
    cache_rows: CacheRows
    #: Optional, ``False`` when absent. ``True`` promises that its layers read
    #: nothing but the cache pools from outside the metadata it returns, in containers
    #: an overlap plugin can walk (:mod:`kvrunner.plugin_api.mirroring`). The core
    #: refuses an overlap plugin over a backend that does not declare it; the kit's
    #: ``metadata_carries_what_layers_read`` checks the promise.
    supports_overlap: bool
    #: Optional, ``False`` when absent. ``True`` promises that, built with
    #: ``context.deterministic``, its layers give each token row the very bits they
    #: would give it alone: whatever other rows share the step, their number and
    #: lengths, the row's place, the chunk its token came in, whether its prefix was
    #: computed in this step or an earlier one, and prefill or decode alike. The core
    #: refuses ``deterministic`` over a backend that does not declare it (the
    #: engine-level property tests of ``tests/core/determinism`` hold ``paged`` to it).
    batch_invariant: bool
    #: Optional, ``("auto",)`` when absent. The ``kv_cache_dtype`` values it accepts
    #: (``"auto"``, ``"fp8"``): one it lists reaches it as ``context.kv_cache_dtype``,
    #: and the core refuses an engine whose ``kv_cache_dtype`` a selected backend does
    #: not list. A backend holding no keys and values (recurrent state) may list
    #: ``"fp8"`` and keep its state in the model's dtype, as vLLM keeps mamba state.
    kv_cache_dtypes: tuple[str, ...]

    def __call__(self, context: BackendContext) -> Any:
        """The backend object, registered on the runner's plugin manager."""
        ...


def declares_overlap_support(factory: object) -> bool:
    """Whether ``factory`` declares ``supports_overlap = True`` (absent means no)."""
    return getattr(factory, "supports_overlap", False) is True


def declares_batch_invariance(factory: object) -> bool:
    """Whether ``factory`` declares ``batch_invariant = True`` (absent means no)."""
    return getattr(factory, "batch_invariant", False) is True


def accepted_kv_cache_dtypes(factory: object) -> tuple[str, ...]:
    """The ``kv_cache_dtype`` values ``factory`` accepts (absent means ``("auto",)``)."""
    return getattr(factory, "kv_cache_dtypes", ("auto",))
