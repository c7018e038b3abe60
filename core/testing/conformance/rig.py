"""A backend set up the way a runner sets it up, driven one step at a time.

The rig builds a real :class:`~kvrunner.plugin_host.backend_manager.BackendManager` for one backend
over a small model whose other layers it does not serve, the core's step builder
and forward_vars, allocates the pools (NaN-poisoned, so a read of anything never
written shows), and runs the served layers for a step with deterministic inputs:
every sequence's inputs are a function of the case seed, the sequence and the
layer, so a reference can recompute any sequence's whole history.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import attrs
import torch

from kvrunner.engine.step_io import SamplingColumns, StepInput
from kvrunner.plugin_api.errors import BackendError
from kvrunner.plugin_api.factory import (
    CacheRows,
    accepted_kv_cache_dtypes,
    declares_batch_invariance,
    declares_overlap_support,
)
from kvrunner.plugin_api.step_data import ForwardContext, ModelSpec, StepMetadata
from kvrunner.plugin_host.plugins import discover_backends
from kvrunner.runner.step.forward_vars import ForwardVars
from kvrunner.runner.step.step_batch import prepare_step
from kvrunner.runner.step.step_metadata import StepMetadataBuilder
from kvrunner.sampling_params import SamplingParams
from kvrunner.testing.conformance import cases
from kvrunner.testing.conformance.cases import Seq, StepCase
from kvrunner.testing.conformance.errors import ConformanceError
from kvrunner.testing.harness import backend_manager

FULL, LINEAR = "full_attention", "linear_attention"
#: a layer's forward inputs for some token rows, from the sequence's full inputs
Rows = list[tuple[Seq, int, int]]
#: ``guard(layer_index)``: a context entered around one layer's forward
LayerGuard = Callable[[int], AbstractContextManager]


@attrs.frozen(kw_only=True)
class Target:
    """A backend under test: its name, the layer type to drive, how to read its cache."""

    name: str
    layer_type: str
    cache_rows: CacheRows
    use_triton: bool = False
    device: str = "cpu"
    #: an overlap plugin on top of the backend (its micro-batches are run in turns)
    overlap: str | None = None
    #: the factory declares ``supports_overlap`` (the kit then checks the promise)
    supports_overlap: bool = False
    #: the factory declares ``batch_invariant`` (the kit then checks the promise)
    batch_invariant: bool = False
    #: how the backend stores keys and values (``context.kv_cache_dtype``); with "fp8"
    #: the reference attends keys and values rounded to e4m3 at scale 1.0, the default
    #: per-tensor scale
    kv_cache_dtype: str = "auto"

    @classmethod
    def of(
        cls, name: str, *, use_triton: bool = False, device: str = "cpu",
        overlap: str | None = None, kv_cache_dtype: str = "auto",
    ) -> list[Target]:
        """One target per layer type the installed backend ``name`` serves, reading its
        cache through the factory's ``cache_rows`` attribute (``overlap``: with that
        overlap plugin on top, cutting every step it can; ``kv_cache_dtype``: the
        backend built with it, refused where its factory does not list it)."""
        found = discover_backends()
        if name not in found:
            raise BackendError(f"backend {name!r} is not installed; installed: {sorted(found)}")
        factory = found[name].load()
        supports_overlap = declares_overlap_support(factory)
        batch_invariant = declares_batch_invariance(factory)
        if overlap is not None and not supports_overlap:
            raise BackendError(
                f"overlap plugin {overlap!r} cannot run over backend {name!r}: {name!r} does "
                f"not declare supports_overlap = True (docs/plugins.md, 'Overlap plugins')"
            )
        if kv_cache_dtype not in accepted_kv_cache_dtypes(factory):
            raise BackendError(
                f"kv_cache_dtype={kv_cache_dtype!r}: backend {name!r} accepts "
                f"{list(accepted_kv_cache_dtypes(factory))} (its kv_cache_dtypes)"
            )
        # cache_rows is required of every layer backend, checked at load
        return [
            cls(name=name, layer_type=t, cache_rows=factory.cache_rows, use_triton=use_triton,
                device=device, overlap=overlap, supports_overlap=supports_overlap,
                batch_invariant=batch_invariant, kv_cache_dtype=kv_cache_dtype)
            for t in factory.layer_types
            if t in (FULL, LINEAR)
        ]


def kit_model_spec(layer_type: str) -> ModelSpec:
    """Three layers; the backend serves 0 and 2, the middle one is the other type."""
    other = LINEAR if layer_type == FULL else FULL
    return ModelSpec(
        num_layers=3, layer_types=(layer_type, other, layer_type), num_heads=4, num_kv_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4,
    )  # fmt: skip


class Rig:
    """One backend, set up as a runner would; see the module docstring."""

    def __init__(self, target: Target, seed: int = 0) -> None:
        self.target = target
        self.seed = seed
        self.spec = kit_model_spec(target.layer_type)
        self.device = torch.device(target.device)
        self.manager = backend_manager(
            {target.layer_type: target.name}, self.spec, block_size=cases.BLOCK_SIZE,
            max_num_seqs=cases.MAX_SEQS, max_num_batched_tokens=cases.MAX_TOKENS,
            max_model_len=cases.MAX_MODEL_LEN, device=target.device,
            use_triton=target.use_triton, overlap=target.overlap,
            kv_cache_dtype=target.kv_cache_dtype,
        )  # fmt: skip
        self.served = self.spec.layers_of_type(target.layer_type)
        self.layers = {
            i: self.manager.make_layer(layer_index=i, layer_type=target.layer_type)
            for i in self.served
        }
        self.step_builder = StepMetadataBuilder(
            max_batch=cases.MAX_SEQS, max_tokens=cases.MAX_TOKENS,
            max_blocks_per_seq=-(-cases.MAX_MODEL_LEN // cases.BLOCK_SIZE), device=self.device,
        )  # fmt: skip
        self.forward_vars = ForwardVars()
        self.forward_vars.register(
            "input_ids", torch.zeros(cases.MAX_TOKENS, dtype=torch.int64, device=self.device)
        )
        self.forward_vars.register_all(self.step_builder.buffers())
        self.buffers = self.manager.persistent_buffers(
            max_batch=cases.MAX_SEQS, max_tokens=cases.MAX_TOKENS
        )
        self.forward_vars.register_all(self.buffers)
        self.pools: dict[str, torch.Tensor] = {}
        self.allocate()

    # -- the pools ------------------------------------------------------------------------

    def allocate(self) -> None:
        """Allocate (again, after a release) and poison every floating pool with NaN."""
        try:
            self.pools = self.manager.allocate_cache(
                num_blocks=cases.NUM_BLOCKS, num_slots=cases.NUM_SLOTS
            )
        except BackendError as e:  # cache_spec_matches_allocation's rule, at every check
            raise ConformanceError(str(e)) from None
        for pool in self.pools.values():
            if pool.is_floating_point():
                pool.fill_(float("nan"))

    @staticmethod
    def pools_bound() -> int:
        """Row indices below this are valid as a KV block, a KV slot and a state slot."""
        return min(cases.NUM_BLOCKS, cases.NUM_SLOTS)

    def rows(self) -> dict[str, tuple[str, torch.Tensor]]:
        """Every pool as ``(kind, rows)`` through the backend's ``cache_rows``; copies."""
        out = {}
        for name, pool in self.pools.items():
            kind, rows = self.target.cache_rows(name.split(".", 1)[1], pool)
            if kind not in ("kv", "state"):
                raise ValueError(f"cache_rows gave kind {kind!r} for {name}; 'kv' or 'state'")
            out[name] = (kind, rows.detach().cpu().clone())
        return out

    # -- inputs ---------------------------------------------------------------------------

    def _generator(self, uid: int, layer: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 7919 + uid * 131 + layer)

    def seq_inputs(self, seq: Seq, layer: int) -> tuple[torch.Tensor, ...]:
        """The sequence's inputs at every position ``0 .. seq.length - 1`` (CPU, fp32)."""
        gen, s, n = self._generator(seq.uid, layer), self.spec, seq.length
        r = lambda *shape: torch.randn(*shape, generator=gen)
        if self.target.layer_type == FULL:
            return r(n, s.num_heads, s.head_dim), r(n, s.num_kv_heads, s.head_dim), r(
                n, s.num_kv_heads, s.head_dim
            )
        conv_dim = 2 * s.linear_num_key_heads * s.linear_key_head_dim
        conv_dim += s.linear_num_value_heads * s.linear_value_head_dim
        g = -torch.rand(n, s.linear_num_value_heads, generator=gen)
        beta = torch.rand(n, s.linear_num_value_heads, generator=gen)
        return r(n, conv_dim), g, beta

    def conv_params(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv weight ``[conv_dim, kernel]`` and bias of a linear-attention layer."""
        gen = self._generator(-1, layer)
        s = self.spec
        conv_dim = 2 * s.linear_num_key_heads * s.linear_key_head_dim
        conv_dim += s.linear_num_value_heads * s.linear_value_head_dim
        return (
            torch.randn(conv_dim, s.linear_conv_kernel_dim, generator=gen) * 0.5,
            torch.randn(conv_dim, generator=gen) * 0.1,
        )

    def step_inputs(self, rows: Rows, layer: int, pad_rows: int) -> list[torch.Tensor]:
        """The layer's inputs for these rows, then ``pad_rows`` rows of arbitrary values."""
        parts = [
            [t[start:end] for t in self.seq_inputs(seq, layer)] for seq, start, end in rows
        ]
        cols = [torch.cat(c) for c in zip(*parts, strict=True)]
        if pad_rows:
            gen = torch.Generator().manual_seed(layer)
            # Arbitrary but finite, as a replayed graph's padded rows are (token 0); a
            # linear layer's decay stays <= 0.
            pad = [torch.rand((pad_rows, *c.shape[1:]), generator=gen) for c in cols]
            if self.target.layer_type == LINEAR:
                pad[1] = -pad[1]
            cols = [torch.cat([c, p]) for c, p in zip(cols, pad, strict=True)]
        return [c.to(self.device) for c in cols]

    # -- steps ----------------------------------------------------------------------------

    def step(self, rows: Rows, *, padded: int | None = None) -> StepMetadata:
        """The core's shared metadata for these rows (padded to ``padded`` sequences)."""
        columns = StepInput(
            seq_id=[s.uid for s, _, _ in rows],
            token_ids=[(0,) * (end - start) for _, start, end in rows],
            start_pos=[start for _, start, _ in rows],
            block_table=[s.blocks for s, _, _ in rows],
            state_slot=[s.slot for s, _, _ in rows],
            sample=[False] * len(rows),
            sampling=SamplingColumns.of([SamplingParams()] * len(rows)),
            num_output_tokens=[0] * len(rows),
        )
        prepared = prepare_step(
            columns, block_size=cases.BLOCK_SIZE, num_padded_seqs=padded
        )
        return self.step_builder.fill(prepared.batch)

    def layer_inputs(self, rows: Rows, layer: int, pad_rows: int = 0) -> list[torch.Tensor]:
        """The layer's forward arguments before ``ctx``, on the device: three per-token
        tensors (q, k, v; or mixed_qkv, g, beta), then a linear layer's conv weight
        and bias."""
        inputs = self.step_inputs(rows, layer, pad_rows)
        if self.target.layer_type == LINEAR:
            inputs += [t.to(self.device) for t in self.conv_params(layer)]
        return inputs

    def forward(
        self, rows: Rows, ctx: ForwardContext, *, pad_rows: int = 0,
        layer_guard: LayerGuard | None = None,
    ) -> dict[int, torch.Tensor]:
        """Every served layer's output for these rows (CPU); ``layer_guard(i)``, when
        given, is entered around layer ``i``'s forward alone (its inputs are made and
        its output read back outside it)."""
        outputs = {}
        for i, layer in self.layers.items():
            inputs = self.layer_inputs(rows, i, pad_rows)
            with layer_guard(i) if layer_guard else nullcontext():
                out = run_layer(layer, inputs, ctx)
            outputs[i] = out.cpu()
        return outputs

    def serve(self, rows: Rows, *, pad_rows: int = 0,
              layer_guard: LayerGuard | None = None) -> dict[int, torch.Tensor]:
        """Build metadata for a real step and run it (padded with ``pad_rows`` PAD rows)."""
        padded = len(rows) + pad_rows if pad_rows else None
        ctx = self.manager.build_metadata(self.step(rows, padded=padded))
        return self.forward(rows, ctx, pad_rows=pad_rows, layer_guard=layer_guard)

    def serve_history(self, case: StepCase) -> None:
        for rows in case.history():
            self.serve(rows)

    def capture_context(self, batch_size: int) -> ForwardContext:
        """What the capture loop does for one size: blank every target, then build."""
        for t in self.manager.cache_write_targets():
            t.buffer.fill_(t.pad_value)
        return self.manager.build_capture_metadata(self.step_builder.fill_capture(batch_size))


def run_layer(layer: Any, inputs: Sequence[torch.Tensor], ctx: ForwardContext) -> torch.Tensor:
    """One layer's forward over ``inputs`` (three per-token tensors, then any others);
    a step an overlap plugin cut runs part by part, each with its own metadata."""
    if not ctx.micro_batches:
        return layer.forward(*inputs, ctx)
    per_token, rest = inputs[:3], inputs[3:]
    return torch.cat([
        layer.forward(*[t[part.tokens] for t in per_token], *rest, part.context)
        for part in ctx.micro_batches
    ])


def live_rows(rows: Sequence[tuple[Seq, int, int]]) -> dict[str, set[int]]:
    """The KV slots and state slots a step may write, by kind."""
    kv = set()
    for seq, start, end in rows:
        kv |= {seq.blocks[p // cases.BLOCK_SIZE] * cases.BLOCK_SIZE + p % cases.BLOCK_SIZE
               for p in range(start, end)}  # fmt: skip
    return {"kv": kv, "state": {seq.slot for seq, _, _ in rows}}
