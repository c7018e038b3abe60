"""The routed experts a step returns: read from the routes pool at the slots of the
positions its rows ask for (``StepInput.route_from``), after the step's forward.

A row asks from its first position the host does not hold yet to the end of its
chunk, so a read may reach back before the chunk: to a prompt prefix the prefix
cache supplied (its routes were written when that block was computed), or to
positions an earlier step already returned (the host keeps the first copy). Only
the rank that samples reads; under tensor parallelism every rank routes alike.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from kvrunner.engine.step_io import StepInput, StepRoutes
from kvrunner.layers.expert_routes import RoutesPool
from kvrunner.plugin_api.buffers import on_device


@attrs.frozen(kw_only=True)
class RoutePlan:
    """Which slots a step reads: row ``i`` (``seq_ids[i]``) owns ``counts[i]``
    consecutive entries of ``slots``, its positions from ``firsts[i]`` on."""

    seq_ids: list[int]
    firsts: list[int]
    counts: list[int]
    slots: np.ndarray  #: int64


def route_plan(step: StepInput, block_size: int) -> RoutePlan | None:
    """The slots ``step``'s rows ask routes for; None when no row asks."""
    if step.route_from is None:
        return None
    seq_ids, firsts, counts, slots = [], [], [], []
    tables = step.block_table.array
    for i, (seq_id, tokens, start, first) in enumerate(zip(
        step.seq_id, step.token_ids, step.start_pos, step.route_from, strict=True,
    )):
        if first < 0:
            continue
        end = start + len(tokens)
        if not 0 <= first <= start:
            raise ValueError(f"sequence {seq_id}: routes asked from position {first}, "
                             f"outside 0..{start} (its chunk starts at {start})")
        positions = np.arange(first, end, dtype=np.int64)
        slots.append(tables[i, positions // block_size].astype(np.int64) * block_size
                     + positions % block_size)
        seq_ids.append(seq_id)
        firsts.append(first)
        counts.append(end - first)
    if not seq_ids:
        return None
    return RoutePlan(seq_ids=seq_ids, firsts=firsts, counts=counts,
                     slots=np.concatenate(slots))


@attrs.frozen(kw_only=True)
class ReadRoutes:
    """A step's routes, on the device until :meth:`to_host` and :meth:`packed`."""

    plan: RoutePlan
    #: ``[tokens, sparse layers, top_k]`` int32
    ids: torch.Tensor
    #: the model layer of each sparse layer, and how many layers the model has
    sparse_layers: tuple[int, ...]
    num_layers: int

    def to_host(self) -> ReadRoutes:
        """The same routes with a non-blocking copy to the host queued (CUDA)."""
        return attrs.evolve(self, ids=self.ids.to("cpu", non_blocking=True))

    def packed(self) -> dict[int, StepRoutes]:
        """``{seq_id: (first position, [tokens, model layers, top_k] int32)}``: a dense
        layer's entries are -1 (reading waits for the device)."""
        ids = self.ids.numpy()
        full = np.full((ids.shape[0], self.num_layers, ids.shape[2]), -1, dtype=ids.dtype)
        full[:, list(self.sparse_layers)] = ids
        out: dict[int, StepRoutes] = {}
        at = 0
        for seq_id, first, count in zip(self.plan.seq_ids, self.plan.firsts, self.plan.counts,
                                        strict=True):
            out[seq_id] = (first, full[at : at + count])
            at += count
        return out


def read_routes(pool: RoutesPool, plan: RoutePlan) -> ReadRoutes:
    """Queue the read of ``plan``'s slots from ``pool`` (after the step's forward, on
    the same stream); nothing waits here."""
    if pool.tensor is None:
        raise RuntimeError("the routed-experts pool is not allocated (the engine sleeps)")
    slots = on_device(plan.slots, torch.int64, pool.device)
    ids = pool.tensor.index_select(1, slots).permute(1, 0, 2).contiguous()
    return ReadRoutes(plan=plan, ids=ids, sparse_layers=pool.sparse_layers,
                      num_layers=pool.num_model_layers)
