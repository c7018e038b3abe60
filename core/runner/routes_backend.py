"""``RoutesBackend``: the core's own backend keeping each token's routed experts.

It serves no layer type. The core adds it beside the configured backends when the
engine runs with ``enable_return_routed_experts`` over a model with sparse layers,
so the routes pool (``layers/expert_routes.py``) is one more cache under the plugin
contract, with nothing special-cased: ``cache_spec`` counts it in the pool sizing,
``allocate_cache`` / ``release_cache`` follow sleep and wake, its one write target
(``slot_mapping``) is blanked before every capture and checked by the capture and
step audits, its ``cache_rows`` lets the audits read the pool slot by slot, and an
overlap plugin gives each micro-batch its own copy of the slots (it declares
``supports_overlap``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvrunner.config import ConfigError, EngineConfig
from kvrunner.layers.expert_routes import RouteRecorder, RoutesMetadata, RoutesPool
from kvrunner.layers.moe import SparseMoeBlock
from kvrunner.plugin_api import (
    PAD_SLOT_ID,
    PLUGIN_API_VERSION,
    BackendContext,
    CacheSpec,
    CacheWriteTarget,
    StepMetadata,
    fill_head,
    hookimpl,
)

#: the name it is registered under (a backend of that name cannot be installed beside it)
ROUTES_BACKEND = "routed_experts"
#: its one pool, as ``allocate_cache`` names it
POOL_NAME = "routes"


def cache_rows(pool_name: str, pool: torch.Tensor) -> tuple[str, torch.Tensor]:
    """Row ``s`` is KV slot ``s``'s expert ids over every sparse layer."""
    del pool_name
    return "kv", pool.permute(1, 0, 2)


class RoutesBackend:
    """The routes pool and the slot mapping its writes go through (made by
    :func:`routes_backend` over the runner's :class:`RoutesPool`)."""

    plugin_api_version = PLUGIN_API_VERSION
    layer_types: tuple[str, ...] = ()
    cache_rows = staticmethod(cache_rows)
    #: the layers read the slots from the metadata it returns, nothing else
    supports_overlap = True
    #: a token's routes are written where its row says, whatever shares the step
    batch_invariant = True

    def __init__(self, context: BackendContext, pool: RoutesPool) -> None:
        self.context = context
        self.pool = pool
        self.slot_mapping: torch.Tensor | None = None

    @hookimpl
    def cache_spec(self) -> CacheSpec:
        """Every sparse layer's ``top_k`` int32 ids for each slot of a block."""
        return CacheSpec(bytes_per_block=self.pool.bytes_per_block)

    @hookimpl
    def allocate_cache(self, num_blocks: int) -> dict[str, torch.Tensor]:
        """The one zeroed pool, ``[sparse layers, num_blocks * block_size, top_k]``."""
        return {POOL_NAME: self.pool.allocate(num_blocks)}

    @hookimpl
    def release_cache(self) -> None:
        """Drop the pool; the layers find the next one through :class:`RoutesPool`."""
        self.pool.release()

    @hookimpl
    def persistent_buffers(self, max_batch: int, max_tokens: int) -> dict[str, torch.Tensor]:
        """``slot_mapping``: each token row's KV slot, PAD-filled until a step fills it."""
        self.slot_mapping = torch.full((max_tokens,), PAD_SLOT_ID, dtype=torch.int64,
                                       device=self.context.device)
        return {"slot_mapping": self.slot_mapping}

    @hookimpl
    def build_metadata(self, step: StepMetadata) -> RoutesMetadata:
        """The step's slots, PAD on every row past its real tokens."""
        assert self.slot_mapping is not None  # persistent_buffers comes first
        fill_head(self.slot_mapping, step.host.slot_mapping[: step.num_tokens], PAD_SLOT_ID)
        return RoutesMetadata(slot_mapping=self.slot_mapping[: step.num_padded_tokens])

    @hookimpl
    def build_capture_metadata(self, step: StepMetadata) -> RoutesMetadata:
        """The slots as the core blanked them: a capture records no route."""
        assert self.slot_mapping is not None
        return RoutesMetadata(slot_mapping=self.slot_mapping[: step.num_padded_tokens])

    @hookimpl
    def cache_write_targets(self) -> list[CacheWriteTarget]:
        """``slot_mapping``: where every sparse layer writes each row's expert ids."""
        assert self.slot_mapping is not None
        return [CacheWriteTarget(name="slot_mapping", buffer=self.slot_mapping,
                                 pad_value=PAD_SLOT_ID)]


def routes_backend(pool: RoutesPool) -> type[RoutesBackend]:
    """The factory the backend manager calls with a context: a :class:`RoutesBackend`
    over ``pool``."""

    class Routes(RoutesBackend):
        def __init__(self, context: BackendContext) -> None:
            super().__init__(context, pool)

    return Routes


def routes_pool(model_config: Any, config: EngineConfig, device: torch.device) -> RoutesPool:
    """The pool for ``model_config``'s sparse layers (its ``moe``, the parsed config's).

    :raises ConfigError: for a model without a sparse layer.
    """
    moe = getattr(model_config, "moe", None)
    if moe is None:
        raise ConfigError(
            "enable_return_routed_experts=True: the model has no mixture-of-experts layer, "
            "so no token is routed to an expert"
        )
    return RoutesPool(sparse_layers=moe.sparse_layers,
                      num_model_layers=model_config.num_hidden_layers, top_k=moe.top_k,
                      block_size=config.cache.block_size, device=device)


def attach_route_recorders(model: nn.Module, pool: RoutesPool) -> None:
    """Give every sparse block of ``model`` its recorder, in layer order (its row of
    the pool); the blocks must be as many as the pool's layers."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    if len(blocks) != pool.num_layers:
        raise RuntimeError(f"{len(blocks)} sparse blocks for a routes pool of "
                           f"{pool.num_layers} layers")
    for index, block in enumerate(blocks):
        block.routes = RouteRecorder(backend=ROUTES_BACKEND, pool=pool, layer=index)
