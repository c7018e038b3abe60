"""The smallest complete kvrunner backend: full attention over a paged KV cache.

Keys and values of every layer live in one ``[2, num_blocks * block_size, kv_heads,
head_dim]`` tensor, indexed by KV slot (``block * block_size + offset``). The core
hands each step's shared read side (query offsets, context lengths, block tables);
this backend owns one buffer, ``slot_mapping``: where each token's keys and values
go, PAD (-1) for rows that must write nothing. Its layers read both from the
metadata it returns, never from the backend object, so an overlap plugin can hand
each micro-batch its own copy (``supports_overlap``).
"""

from __future__ import annotations

import attrs
import torch

from kvrunner.plugin_api import (
    PAD_SLOT_ID,
    PLUGIN_API_VERSION,
    BackendContext,
    CacheSpec,
    CacheWriteTarget,
    ForwardContext,
    StepMetadata,
    fill_head,
    hookimpl,
)


@attrs.frozen
class MinimalMetadata:
    """What the layers read for one step: the core's read side and the write slots."""

    step: StepMetadata
    slot_mapping: torch.Tensor


def cache_rows(pool_name: str, pool: torch.Tensor) -> tuple[str, torch.Tensor]:
    """For the conformance kit: row ``i`` of a pool is KV slot ``i``."""
    return "kv", pool.transpose(0, 1)


class MinimalBackend:
    plugin_api_version = PLUGIN_API_VERSION
    layer_types = ("full_attention",)
    cache_rows = staticmethod(cache_rows)
    supports_overlap = True

    def __init__(self, context: BackendContext) -> None:
        self.context = context
        self.kv: dict[int, torch.Tensor] = {}
        self.slot_mapping: torch.Tensor | None = None

    @hookimpl
    def cache_spec(self) -> CacheSpec:
        """Keys and values of one block, over every layer served."""
        c, m = self.context, self.context.model
        per_layer = 2 * c.block_size * m.num_kv_heads * m.head_dim * c.dtype.itemsize
        return CacheSpec(bytes_per_block=per_layer * len(c.layers))

    @hookimpl
    def allocate_cache(self, num_blocks: int) -> dict[str, torch.Tensor]:
        """One pool per layer; layers look theirs up on every forward (a wake re-allocates)."""
        c, m = self.context, self.context.model
        shape = (2, num_blocks * c.block_size, m.num_kv_heads, m.head_dim)
        self.kv = {i: torch.zeros(shape, dtype=c.dtype, device=c.device) for i in c.layers}
        return {f"kv.{i}": pool for i, pool in self.kv.items()}

    @hookimpl
    def release_cache(self) -> None:
        """Drop the pools."""
        self.kv = {}

    @hookimpl
    def persistent_buffers(self, max_tokens: int) -> dict[str, torch.Tensor]:
        """``slot_mapping``, created once: captured graphs read it by address."""
        self.slot_mapping = torch.full(
            (max_tokens,), PAD_SLOT_ID, dtype=torch.int64, device=self.context.device
        )
        return {"slot_mapping": self.slot_mapping}

    @hookimpl
    def build_metadata(self, step: StepMetadata) -> MinimalMetadata:
        """This step's slots, PAD on every row after them."""
        fill_head(self.slot_mapping, step.host.slot_mapping, PAD_SLOT_ID)
        return MinimalMetadata(step, self.slot_mapping)

    @hookimpl
    def build_capture_metadata(self, step: StepMetadata) -> MinimalMetadata:
        """The core's capture step as is; ``slot_mapping`` stays as the core blanked it."""
        return MinimalMetadata(step, self.slot_mapping)

    @hookimpl
    def cache_write_targets(self) -> list[CacheWriteTarget]:
        """The one buffer the layers write the cache through."""
        return [CacheWriteTarget(name="slot_mapping", buffer=self.slot_mapping)]

    @hookimpl
    def make_layer(self, layer_index: int) -> MinimalAttention:
        """Attention for one layer."""
        return MinimalAttention(self, layer_index)


class MinimalAttention:
    """Store this step's keys and values, then attend each query over its context."""

    def __init__(self, backend: MinimalBackend, layer_index: int) -> None:
        self.backend = backend
        self.layer_index = layer_index

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        be = self.backend
        md = ctx.for_backend(be.context.name, MinimalMetadata)
        step, kv = md.step, be.kv[self.layer_index]  # the pool is shared: looked up here
        slots = md.slot_mapping[: q.shape[0]]
        live = slots >= 0  # PAD rows write nothing
        kv[0, slots[live]] = k[live].to(kv.dtype)
        kv[1, slots[live]] = v[live].to(kv.dtype)
        out = torch.zeros_like(q)
        block_size, group = be.context.block_size, q.shape[1] // k.shape[1]
        # Read sizes from the buffers, not from Python values: a replayed graph keeps
        # the metadata of its capture, and only the buffers' contents change.
        starts, lens = step.query_start_loc.tolist(), step.context_lens.tolist()
        for seq in range(len(lens)):
            first, end, context = starts[seq], starts[seq + 1], lens[seq]
            if end == first or context == 0:
                continue
            pos = torch.arange(context, device=q.device)
            read = step.block_tables[seq, pos // block_size].long() * block_size + pos % block_size
            keys = kv[0, read].repeat_interleave(group, dim=1).float()
            values = kv[1, read].repeat_interleave(group, dim=1).float()
            scores = torch.einsum("qhd,khd->hqk", q[first:end].float(), keys)
            query_pos = torch.arange(context - (end - first), context, device=q.device)
            scores = scores * q.shape[-1] ** -0.5
            scores.masked_fill_(pos[None, None, :] > query_pos[None, :, None], float("-inf"))
            out[first:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
        return out
