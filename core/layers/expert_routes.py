"""Routed experts: the expert ids each sparse layer routed a token to, kept at its KV slot.

A request may ask for the experts its tokens went to (``return_routed_experts``, the
R3 recipe: a trainer replays the rollout's routing). They are recorded where the
token's keys live: a pool ``[num_sparse_layers, num_blocks * block_size, top_k]``
int32 indexed by KV slot, written inside the forward at the step's slot mapping.
So a request that reuses a cached prompt block reads the routes the block was
computed with, and decode graphs, asynchronous steps, micro-batches and
recomputation after a preemption need nothing of their own: each writes its rows'
slots, as the attention's keys are written.

The write is graph-safe and writes nothing through a padded row (slot
``PAD_SLOT_ID``): every row adds ``ids - old`` at its slot, a padded row adds 0 at
slot 0. Real slots are distinct within a step, so the sum a slot receives is exactly
its own row's change, whichever rows also point there, and in any order (integer
addition: the additions of two micro-batches on two streams commute).
"""

from __future__ import annotations

import attrs
import torch

from kvrunner.plugin_api.step_data import ForwardContext

#: the dtype routes are kept and returned in (SGLang's wire dtype)
ROUTE_DTYPE = torch.int32


@attrs.frozen(kw_only=True)
class RoutesMetadata:
    """What a sparse layer reads for one step (or one micro-batch of it)."""

    #: ``[>= rows]`` int64: each token row's KV slot; PAD (< 0) on rows that write nothing
    slot_mapping: torch.Tensor


class RoutesPool:
    """The pool, looked up at every write: a sleep releases it and a wake makes another."""

    def __init__(self, *, sparse_layers: tuple[int, ...], num_model_layers: int, top_k: int,
                 block_size: int, device: torch.device) -> None:
        #: the model layer of each of the pool's layers, in order
        self.sparse_layers = tuple(sparse_layers)
        self.num_model_layers = num_model_layers
        self.num_layers = len(self.sparse_layers)
        self.top_k = top_k
        self.block_size = block_size
        self.device = device
        self.tensor: torch.Tensor | None = None

    @property
    def bytes_per_block(self) -> int:
        """One block's routes over every sparse layer."""
        element = torch.empty((), dtype=ROUTE_DTYPE).element_size()
        return self.num_layers * self.block_size * self.top_k * element

    def allocate(self, num_blocks: int) -> torch.Tensor:
        """A zeroed pool for ``num_blocks`` blocks (also held here for the layers)."""
        shape = (self.num_layers, num_blocks * self.block_size, self.top_k)
        self.tensor = torch.zeros(shape, dtype=ROUTE_DTYPE, device=self.device)
        return self.tensor

    def release(self) -> None:
        self.tensor = None

    def layer(self, index: int) -> torch.Tensor:
        """Sparse layer ``index``'s ``[slots, top_k]`` rows."""
        if self.tensor is None:
            raise RuntimeError("the routed-experts pool is not allocated (the engine sleeps)")
        return self.tensor[index]


def write_routes(rows: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor) -> None:
    """``rows[slots[t]] = ids[t]`` for every ``t`` whose slot is >= 0; nothing else
    changes (module docstring). Fixed shapes, no host read: it runs inside graphs.

    :param rows: ``[num_slots, top_k]`` int32, one sparse layer's pool.
    :param slots: ``[T]`` int64 (at least the rows of ``ids``).
    :param ids: ``[T, top_k]`` integer expert ids.
    """
    slots = slots[: ids.shape[0]]
    index = slots.clamp(min=0)
    old = rows.index_select(0, index)
    change = torch.where((slots >= 0)[:, None], ids.to(rows.dtype) - old, 0)
    rows.scatter_add_(0, index[:, None].expand_as(change), change)


class RouteRecorder:
    """One sparse layer's recorder: its row of the pool and the metadata naming slots."""

    def __init__(self, *, backend: str, pool: RoutesPool, layer: int) -> None:
        self.backend = backend
        self.pool = pool
        self.layer = layer

    def record(self, ids: torch.Tensor, ctx: ForwardContext) -> None:
        """Write the step's ``[T, top_k]`` expert ids at its token rows' slots."""
        metadata = ctx.for_backend(self.backend, RoutesMetadata)
        write_routes(self.pool.layer(self.layer), metadata.slot_mapping, ids)
