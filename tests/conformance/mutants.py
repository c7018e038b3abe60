"""Backends that each break exactly one property, to show the kit's checks can fail.

Every mutant is the ``paged`` backend with one change; :data:`MUTANTS` maps each
check to the mutant that breaks what it guards.
"""

from __future__ import annotations

import attrs
import torch
from kvrunner_tbo.plugin import TwoBatchOverlap

from kvrunner.plugin_api import (
    PAD_SLOT_ID,
    CacheSpec,
    CacheWriteTarget,
    ForwardContext,
    StepMetadata,
    hookimpl,
)
from kvrunner_gdn import GDNBackend
from kvrunner_paged import PagedAttention, PagedBackend, PagedMetadata
from kvrunner_paged.cache import cache_rows as paged_cache_rows
from kvrunner_paged.ops.paged_attention.inputs import PagedAttentionInputs
from kvrunner_paged.ops.utils import gather_positions


class WrongScale(PagedBackend):
    """Attends with the wrong softmax scale: outputs differ from the reference."""

    @hookimpl
    def make_layer(self, layer_index: int) -> PagedAttention:
        layer = super().make_layer(layer_index)
        layer.scale *= 1.25
        return layer


class ShiftedSlots(PagedBackend):
    """Stores each token one slot past where its block table says."""

    @hookimpl
    def build_metadata(self, step: StepMetadata) -> PagedMetadata:
        md = super().build_metadata(step)
        sm = self.builder.slot_mapping
        sm[: step.num_tokens] += 1
        return md


def _store_ignoring_pad(*, k, v, k_cache, v_cache, slot_mapping, **scales) -> None:  # noqa: ANN001, ANN003
    """Writes every row, PAD ones included (a PAD index wraps to the last slot); pools
    in the model's dtype, so the FP8 scales the layer hands every store go unused."""
    del scales
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    rows = slot_mapping.long() % flat_k.shape[0]
    flat_k[rows] = k.to(flat_k.dtype)
    flat_v[rows] = v.to(flat_v.dtype)


class StoresPadRows(PagedBackend):
    """Its store kernel does not skip PAD rows."""

    @hookimpl
    def make_layer(self, layer_index: int) -> PagedAttention:
        layer = super().make_layer(layer_index)
        layer._store = _store_ignoring_pad
        return layer


class NoTailPad(PagedBackend):
    """Fills the live rows of ``slot_mapping`` and leaves the tail as the last step left it."""

    @hookimpl
    def build_metadata(self, step: StepMetadata) -> PagedMetadata:
        sm = self.builder.slot_mapping
        sm[: step.num_tokens].copy_(step.host.slot_mapping[: step.num_tokens])
        return self.builder._metadata(step)


class BlanksAtCapture(PagedBackend):
    """Blanks its own write side in ``build_capture_metadata`` (the core's job)."""

    @hookimpl
    def build_capture_metadata(self, step: StepMetadata) -> PagedMetadata:
        self.builder.slot_mapping.fill_(PAD_SLOT_ID)
        return super().build_capture_metadata(step)


class DeclaresACopy(PagedBackend):
    """Declares a copy of ``slot_mapping`` as its write target, so blanking misses it."""

    @hookimpl
    def cache_write_targets(self) -> list[CacheWriteTarget]:
        return [CacheWriteTarget(name="slot_mapping", buffer=self.builder.slot_mapping.clone())]


class CaptureSnapshot(PagedBackend):
    """Captures a snapshot of ``slot_mapping``: a replay never sees the step's slots."""

    @hookimpl
    def build_capture_metadata(self, step: StepMetadata) -> PagedMetadata:
        md = super().build_capture_metadata(step)
        return attrs.evolve(md, slot_mapping=md.slot_mapping.clone())


class KeepsFirstPools(PagedBackend):
    """A wake hands the core new pools, but the layers keep the first ones."""

    first: dict[str, torch.Tensor] | None = None

    @hookimpl
    def release_cache(self) -> None:
        pass  # the layers go on looking up the first pools

    @hookimpl
    def allocate_cache(self, num_blocks: int) -> dict[str, torch.Tensor]:
        if self.first is None:
            self.first = self.pools.allocate(num_blocks)
            return self.first
        return {name: torch.zeros_like(pool) for name, pool in self.first.items()}


class CountsSlotsOnHost(PagedBackend):
    """Its store skips a step with no slot to write, counted on the host (on CUDA, a
    wait for the device in every step's forward)."""

    @hookimpl
    def make_layer(self, layer_index: int) -> PagedAttention:
        layer = super().make_layer(layer_index)
        store = layer._store

        def store_unless_empty(*, slot_mapping, **kv) -> None:  # noqa: ANN001, ANN003
            if int((slot_mapping >= 0).sum()) > 0:
                store(slot_mapping=slot_mapping, **kv)

        layer._store = store_unless_empty
        return layer


class BuilderHeldTarget(PagedBackend):
    """Keeps its write target, ``slot_mapping``, on its builder: neither in forward_vars
    nor declared in ``cache_write_targets``."""

    @hookimpl
    def persistent_buffers(self, max_batch: int, max_tokens: int) -> dict[str, torch.Tensor]:
        super().persistent_buffers(max_batch=max_batch, max_tokens=max_tokens)
        return {}

    @hookimpl
    def cache_write_targets(self) -> list[CacheWriteTarget]:
        return []


class WrongPadValue(PagedBackend):
    """Declares PAD 0 for ``slot_mapping``; its kernels skip -1: blanking points every
    captured row at slot 0."""

    @hookimpl
    def cache_write_targets(self) -> list[CacheWriteTarget]:
        return [CacheWriteTarget(name="slot_mapping", buffer=self.builder.slot_mapping,
                                 pad_value=0)]


class UndeclaredMirrors(TwoBatchOverlap):
    """An overlap plugin that mirrors the layer backend's write targets per part and
    declares none of its mirrors: blanking leaves them holding live slots."""

    @hookimpl
    def cache_write_targets(self) -> list[CacheWriteTarget]:
        return []


class _Holder:
    """A plain object one attribute level deep."""

    def __init__(self, **fields: object) -> None:
        self.__dict__.update(fields)


class DeepHeldTarget(BuilderHeldTarget):
    """Keeps its builder (and so its undeclared write target) three attribute levels
    down, ``state.parts.builder``, behind a property the walk does not follow."""

    @property
    def builder(self):  # noqa: ANN201
        state = self.__dict__.get("state")
        return state.parts.builder if state is not None else None

    @builder.setter
    def builder(self, value) -> None:  # noqa: ANN001
        self.__dict__["state"] = _Holder(parts=_Holder(builder=value))


class CaptureReadsLiveBlocks(PagedBackend):
    """Its capture read side is a copy of the block tables the last real step left on
    its builder, not the core's capture step: a replay reads those blocks forever."""

    @hookimpl
    def persistent_buffers(self, max_batch: int, max_tokens: int) -> dict[str, torch.Tensor]:
        buffers = super().persistent_buffers(max_batch=max_batch, max_tokens=max_tokens)
        width = -(-self.context.max_model_len // self.context.block_size)
        self.builder.last_block_tables = torch.zeros(
            (max_batch, width), dtype=torch.int32, device=self.context.device
        )
        return buffers

    @hookimpl
    def build_metadata(self, step: StepMetadata) -> PagedMetadata:
        rows, cols = step.block_tables.shape
        self.builder.last_block_tables[:rows, :cols].copy_(step.block_tables)
        return super().build_metadata(step)

    @hookimpl
    def build_capture_metadata(self, step: StepMetadata) -> PagedMetadata:
        md = super().build_capture_metadata(step)
        rows, cols = step.block_tables.shape
        return attrs.evolve(md, block_tables=self.builder.last_block_tables[:rows, :cols].clone())


class NoReleaseCache(PagedBackend):
    """Allocates pools and has no ``release_cache``."""

    release_cache = None


class ReleaseKeepsMemory(PagedBackend):
    """Its ``release_cache`` keeps the pools "for reuse": a sleep frees nothing."""

    spare: list[dict[int, torch.Tensor]]

    @hookimpl
    def release_cache(self) -> None:
        self.spare = [*getattr(self, "spare", []), self.pools._pools]
        super().release_cache()


class _SlotsFromBuilder:
    """A paged layer that takes ``slot_mapping`` from the backend's builder, not from
    the metadata it is handed."""

    def __init__(self, layer: PagedAttention, backend: PagedBackend) -> None:
        self.layer, self.backend = layer, backend

    def forward(self, q, k, v, ctx: ForwardContext):  # noqa: ANN001, ANN201
        name = self.layer.backend_name
        md = attrs.evolve(ctx.for_backend(name, PagedMetadata),
                          slot_mapping=self.backend.builder.slot_mapping)
        return self.layer.forward(q, k, v, ForwardContext(metadata={**ctx.metadata, name: md}))


class ReadsBuilderSlots(PagedBackend):
    """Declares ``supports_overlap`` but its layers read the write buffer from the
    backend object: under an overlap plugin every micro-batch writes the last one's
    slots."""

    supports_overlap = True

    @hookimpl
    def make_layer(self, layer_index: int) -> _SlotsFromBuilder:
        return _SlotsFromBuilder(super().make_layer(layer_index), self)


def _attend_in_splits(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_pos: torch.Tensor,
    scale: float, splits: int,
) -> torch.Tensor:
    """Causal attention of ``q`` ``[n, heads, dim]`` over ``keys``/``values``
    ``[ctx, heads, dim]``, the keys cut into ``splits`` parts whose partial softmaxes
    are merged (split-KV): exact attention, but a token's sums follow ``splits``."""
    ctx = keys.shape[0]
    scores = torch.einsum("qhd,khd->qhk", q, keys) * scale
    hidden = torch.arange(ctx)[None, None, :] > query_pos[:, None, None]
    scores = scores.masked_fill(hidden, float("-inf"))
    width = -(-ctx // splits)
    maxima, sums, partials = [], [], []
    for lo in range(0, ctx, width):
        part = scores[..., lo : lo + width]
        m = part.amax(-1)
        m = m.where(m.isfinite(), torch.zeros_like(m))  # a part no query sees adds 0
        p = torch.exp(part - m[..., None])
        maxima.append(m)
        sums.append(p.sum(-1))
        partials.append(torch.einsum("qhk,khd->qhd", p, values[lo : lo + width]))
    top = torch.stack(maxima).amax(0)
    weights = [torch.exp(m - top) for m in maxima]
    total = sum(w * s for w, s in zip(weights, sums, strict=True))
    out = sum(w[..., None] * o for w, o in zip(weights, partials, strict=True))
    return out / total[..., None]


class _SplitsByBatch:
    """A paged layer whose deterministic attention cuts each sequence's keys into as
    many splits as the step has sequences."""

    def __init__(self, layer: PagedAttention) -> None:
        self.layer = layer

    def forward(self, q, k, v, ctx: ForwardContext):  # noqa: ANN001, ANN201
        layer = self.layer
        md = ctx.for_backend(layer.backend_name, PagedMetadata)
        k_cache, v_cache = layer.pools.kv(layer.layer_index)
        layer._store(k=k, v=v, k_cache=k_cache, v_cache=v_cache,
                     slot_mapping=md.slot_mapping[: q.shape[0]])
        group = layer.num_heads // layer.num_kv_heads
        step = PagedAttentionInputs(
            q=q, k_cache=k_cache, v_cache=v_cache, block_tables=md.block_tables,
            context_lens=md.context_lens, scale=layer.scale, query_start_loc=md.query_start_loc,
            num_seqs=md.num_seqs)
        out = torch.zeros_like(q)
        for i, lo, hi, length in step.sequence_rows():
            read = torch.arange(length)
            keys = gather_positions(k_cache, md.block_tables[i], read).float()
            values = gather_positions(v_cache, md.block_tables[i], read).float()
            out[lo:hi] = _attend_in_splits(
                q[lo:hi].float(), keys.repeat_interleave(group, dim=1),
                values.repeat_interleave(group, dim=1), torch.arange(length - (hi - lo), length),
                layer.scale, splits=md.num_seqs,
            ).to(q.dtype)  # fmt: skip
        return out


class SplitsByBatch(PagedBackend):
    """Declares ``batch_invariant``, but its attention's split-KV count is the number
    of sequences in the step (exact attention, whose bits follow the batch)."""

    batch_invariant = True

    @hookimpl
    def make_layer(self, layer_index: int) -> _SplitsByBatch:
        return _SplitsByBatch(super().make_layer(layer_index))


class GDNClaimsInvariance(GDNBackend):
    """``gdn`` as it is, declaring ``batch_invariant``: its chunked prefill and its
    recurrent decode sum a token's state in different orders."""

    batch_invariant = True


class StaleSlots(PagedBackend):
    """Fills ``slot_mapping`` from the previous step's host copy where the shapes match:
    every decode step stores its keys where the step before stored its own."""

    last: torch.Tensor | None = None

    @hookimpl
    def build_metadata(self, step: StepMetadata) -> PagedMetadata:
        md = super().build_metadata(step)
        now = step.host.slot_mapping[: step.num_tokens].clone()
        if self.last is not None and self.last.shape == now.shape:
            self.builder.slot_mapping[: step.num_tokens].copy_(self.last)
        self.last = now
        return md


class WritesPositions(PagedBackend):
    """Turns the core's ``positions`` into offsets within a block, in place: rotary then
    reads the wrong positions."""

    @hookimpl
    def build_metadata(self, step: StepMetadata) -> PagedMetadata:
        step.positions.remainder_(self.context.block_size)
        return super().build_metadata(step)


class ReplacesTarget(PagedBackend):
    """Builds a new ``slot_mapping`` tensor every step, under the declared name: the
    graphs and blanking keep the first."""

    @hookimpl
    def build_metadata(self, step: StepMetadata) -> PagedMetadata:
        self.builder.slot_mapping = self.builder.slot_mapping.clone()
        return super().build_metadata(step)


class UnderstatedSpec(PagedBackend):
    """Its ``cache_spec`` promises a quarter of the bytes ``allocate_cache`` takes."""

    @hookimpl
    def cache_spec(self) -> CacheSpec:
        return CacheSpec(bytes_per_block=self.pools.bytes_per_block // 4)


def _copied_rows(pool_name: str, pool: torch.Tensor) -> tuple[str, torch.Tensor]:
    kind, rows = paged_cache_rows(pool_name, pool)
    return kind, rows.clone()


class CopiedRows(PagedBackend):
    """Its ``cache_rows`` hands out a copy of the pool, not a view: a reader through it
    never sees a write."""

    cache_rows = staticmethod(_copied_rows)


#: check -> (mutant name, factory)
MUTANTS = {
    "step_matches_reference": ("mutant-wrong-scale", WrongScale),
    "cache_spec_matches_allocation": ("mutant-understated-spec", UnderstatedSpec),
    "cache_rows_is_a_view": ("mutant-copied-rows", CopiedRows),
    "only_live_rows_change": ("mutant-shifted-slots", ShiftedSlots),
    "core_buffers_untouched": ("mutant-writes-positions", WritesPositions),
    "write_targets_keep_identity": ("mutant-replaces-target", ReplacesTarget),
    "pad_rows_write_nothing": ("mutant-stores-pad-rows", StoresPadRows),
    "write_targets_pad_past_live_rows": ("mutant-no-tail-pad", NoTailPad),
    "capture_metadata_leaves_write_side": ("mutant-blanks-at-capture", BlanksAtCapture),
    "blanked_capture_writes_nothing": ("mutant-declares-a-copy", DeclaresACopy),
    "replay_sees_later_fill": ("mutant-capture-snapshot", CaptureSnapshot),
    "serve_sleep_wake_recapture_under_audit": ("mutant-keeps-first-pools", KeepsFirstPools),
    "forward_reads_nothing_on_the_host": ("mutant-counts-slots-on-host", CountsSlotsOnHost),
    "release_cache_frees_the_pools": ("mutant-release-keeps-memory", ReleaseKeepsMemory),
    "metadata_carries_what_layers_read": ("mutant-reads-builder-slots", ReadsBuilderSlots),
    "probe_bits_match_alone": ("mutant-splits-by-batch", SplitsByBatch),
}
#: defects the runtime audit (``LLM(..., audit=True)``) catches as the kit does:
#: mutant name -> (factory, the kit check that catches it)
AUDIT_MUTANTS = {
    "mutant-builder-held-target": (BuilderHeldTarget, "blanked_capture_writes_nothing"),
    "mutant-deep-held-target": (DeepHeldTarget, "blanked_capture_writes_nothing"),
    "mutant-wrong-pad-value": (WrongPadValue, "blanked_capture_writes_nothing"),
    "mutant-capture-reads-live-blocks": (CaptureReadsLiveBlocks, "replay_sees_later_fill"),
    "mutant-stores-pad-rows": (StoresPadRows, "pad_rows_write_nothing"),
}
#: defects the step audit catches at the step that commits them (the capture audit
#: passes them): mutant name -> factory
STEP_MUTANTS = {
    "mutant-shifted-slots": ShiftedSlots,
    "mutant-no-tail-pad": NoTailPad,
    "mutant-stale-slots": StaleSlots,
}
