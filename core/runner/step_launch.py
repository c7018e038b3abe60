"""One step on one rank, up to its samples on the device.

``launch`` prepares the step, fills its placeholders from the last step's tokens on
the device, replays the decode graph (which ends with the logits, and on rank 0 with
the tokens where it can draw them, checked for non-finite rows: ``graph_sampling.py``)
or runs eagerly, samples and checks what the graph did not on rank 0, and returns
a :class:`~kvrunner.runner.step.launched_step.LaunchedStep` without waiting for the
device: with asynchronous steps the host schedules the next step meanwhile.
``execute`` is ``launch`` followed by ``result()``.

:class:`StepLauncher` owns what lives from one step to the next: the last step's
tokens on the device, the non-finite row count, and the graphs' sampling buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import attrs
import torch

from kvrunner.distributed.group import DistGroup
from kvrunner.engine.step_io import PackedSampled, StepInput
from kvrunner.layers.expert_routes import RoutesPool
from kvrunner.layers.nonfinite_rows import mark_nonfinite
from kvrunner.layers.prompt_logprobs import PromptRows, ScoredPrompts, prompt_rows, score_prompts
from kvrunner.layers.sampler import Sampler
from kvrunner.layers.sampling_seeds import row_keys
from kvrunner.plugin_api.buffers import on_device
from kvrunner.plugin_api.step_data import ForwardContext
from kvrunner.plugin_host.backend_manager import BackendManager
from kvrunner.runner.capture.graph_capture import GraphCapture
from kvrunner.runner.capture.graph_sampling import DecodeOutputs, GraphSampling
from kvrunner.runner.capture.graphs import DecodeGraph
from kvrunner.runner.step.forward_vars import ForwardVars
from kvrunner.runner.step.launched_step import DeviceTokens, LaunchedStep, feed_placeholders
from kvrunner.runner.step.step_audit import StepAudit
from kvrunner.runner.step.step_batch import prepare_step
from kvrunner.runner.step.step_metadata import StepMetadataBuilder
from kvrunner.runner.step.step_routes import ReadRoutes, read_routes, route_plan

#: the model's forward over the first ``num_rows`` rows of the persistent buffers
ForwardRows = Callable[[int, ForwardContext], torch.Tensor]

#: where a step the decode graph draws is checked for non-finite rows (see
#: :attr:`StepLauncher.nonfinite_check`)
NonfiniteCheck = Literal["graph", "after_replay", "off"]


class StepLauncher:
    """Launches one rank's steps.

    :param forward_rows: the model's forward (eager, or an overlap plugin's).
    :param samples: whether this rank draws the tokens (rank 0 only).
    :param shares_samples: whether the draws are broadcast to the other ranks on the
        device (asynchronous steps at TP > 1: the next step feeds them).
    :param routes: the routed-experts pool (``enable_return_routed_experts``), or None.
    """

    def __init__(
        self,
        *,
        block_size: int,
        device: torch.device,
        group: DistGroup | None,
        model: Any,
        backends: BackendManager,
        forward_vars: ForwardVars,
        step_builder: StepMetadataBuilder,
        graphs: GraphCapture,
        sampler: Sampler,
        forward_rows: ForwardRows,
        samples: bool,
        shares_samples: bool,
        max_num_seqs: int,
        vocab_size: int,
        routes: RoutesPool | None = None,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.group = group
        self.model = model
        self.backends = backends
        self.forward_vars = forward_vars
        self.step_builder = step_builder
        self.graphs = graphs
        self.sampler = sampler
        self._forward_rows = forward_rows
        self.samples = samples
        self.shares_samples = shares_samples
        self.vocab_size = vocab_size
        #: the routed-experts pool, read for the rows that ask (None: none recorded)
        self.routes = routes
        #: the buffers of the graphs' draws, on the rank that samples
        self.graph_sampling = (
            GraphSampling(max_num_seqs, vocab_size, device) if samples else None
        )
        #: the last step's tokens, on the device: the next step's placeholders
        self.previous_tokens: DeviceTokens | None = None
        # Counted on the device: a host read here would stall every step.
        self._nan_rows = torch.zeros((), dtype=torch.int64, device=device)
        #: where a step the decode graph draws is checked: ``"graph"`` (inside it,
        #: the default), ``"after_replay"`` (as an eager step is), or ``"off"`` (no
        #: step is checked: for benchmarks only, measuring what the check costs). Read
        #: by the capture too: recapture after changing it.
        self.nonfinite_check: NonfiniteCheck = "graph"
        #: with ``audit=True``, checks every step wrote only where it was told (set once
        #: the pools exist: the start-up profile's step is not audited)
        self.audit: StepAudit | None = None

    @property
    def nan_rows(self) -> int:
        """Sampled rows whose logits were non-finite (NaN, +inf, or all -inf: see
        ``layers/nonfinite_rows.py``), since start (reading waits for the device)."""
        return int(self._nan_rows)

    def execute(self, step: StepInput) -> PackedSampled:
        """Run one step; its sampled tokens as columns (none on ranks > 0, and none
        for a step whose chunks are all mid-prefill)."""
        return self.launch(step).result()

    @torch.inference_mode()
    def launch(self, step: StepInput) -> LaunchedStep:
        """Run one step up to its samples, leaving them on the device; the host may
        prepare the next step before it reads them (:meth:`LaunchedStep.result`)."""
        graph = self.graphs.graph_for(step)
        padded = graph.batch_size if graph is not None else None
        prepared = prepare_step(step, block_size=self.block_size, num_padded_seqs=padded)
        num_tokens = prepared.batch.num_tokens
        rows = padded if padded is not None else num_tokens
        fv = self.forward_vars
        fv["input_ids"][:num_tokens].copy_(prepared.input_ids, non_blocking=True)
        feed_placeholders(fv["input_ids"], step, self.previous_tokens)
        self.previous_tokens = None
        if rows > num_tokens:  # the padded tail of a replayed graph reads token 0 (position 0)
            fv["input_ids"][num_tokens:rows].zero_()
        shared = self.step_builder.fill(prepared.batch)
        audit = self.audit
        if audit is not None:
            audit.begin()
        try:
            ctx = self.backends.build_metadata(shared)
            drawn_in_graph = graph is not None and self._stage_graph_draws(step, graph)
            if graph is not None:
                out: DecodeOutputs = graph.replay()
            else:
                out = DecodeOutputs(self._forward_rows(num_tokens, ctx), None, None, None)
        except BaseException:
            if audit is not None:
                audit.abandon()
            raise
        if audit is not None:
            audit.end(prepared.batch)
        if self.samples:  # before any row samples, whether this step samples or not
            self.sampler.start_histories(step, self.vocab_size, self.device)
        plan = prompt_rows(step)
        scored = None if plan is None else self._score_prompts(out, plan)
        routes = self._read_routes(step)
        if not prepared.sample_rows:
            return LaunchedStep(None, scored, routes)
        rows = prepared.sample_rows
        if rows[-1] == len(rows) - 1:  # rows 0..n-1, as in every decode step: no index copy
            index = None
        else:
            # Through pinned memory: torch.tensor(..., device=cuda) would wait for the
            # step still running, which asynchronous steps exist to overlap.
            index = on_device(rows, torch.int64, self.device)

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t[: len(rows)] if index is None else t.index_select(0, index)

        if out.logits is not None:
            logits = pick(out.logits)
        else:  # every rank joins its all-gather; the sampler widens only what it reads
            logits = self.model.compute_logits(pick(out.hidden), widen=False)
        if not self.samples:
            if self.shares_samples:  # the next step's placeholders need rank 0's draws
                tokens = torch.empty(len(rows), dtype=torch.int64, device=self.device)
                seq_ids = [s for s, wants in zip(step.seq_id, step.sample, strict=True) if wants]
                tokens = self.group.broadcast_from_first(tokens)
                self.previous_tokens = DeviceTokens(seq_ids, tokens)
            return LaunchedStep(None, scored, routes)
        # The graph's tokens live in its memory until the next replay: every reader
        # below (the non-finite count, the copy to the host, the next step's placeholder feed)
        # is queued before that replay, on the same stream.
        drawn = (pick(out.tokens), pick(out.row_max)) if drawn_in_graph else None
        samples = self.sampler.sample_step_rows(logits, step, drawn=drawn)
        # A non-finite row's token reaches the host as its cause's code, so the
        # engine ends that request instead of recording a sample (nonfinite_rows.py);
        # the device keeps the drawn tokens for the next step's placeholders.
        if drawn_in_graph and out.coded is not None:  # checked and counted in the graph
            coded = pick(out.coded)
        elif self.nonfinite_check == "off":
            coded = samples.out.token_ids
        else:
            coded, nonfinite = mark_nonfinite(samples.out.token_ids, samples.out.row_max)
            self._nan_rows += nonfinite
        tokens = samples.out.token_ids
        if self.shares_samples:
            tokens = self.group.broadcast_from_first(tokens)
        # The sampler already listed the sampled rows' ids: the next step's placeholders.
        self.previous_tokens = DeviceTokens(samples.seq_ids, tokens)
        return LaunchedStep(attrs.evolve(samples, out=attrs.evolve(samples.out, token_ids=coded)),
                            scored, routes)

    def _read_routes(self, step: StepInput) -> ReadRoutes | None:
        """The routed experts ``step``'s rows ask for (``runner/step/step_routes.py``),
        read on the rank that samples, after the forward wrote this step's."""
        plan = route_plan(step, self.block_size) if self.samples else None
        if plan is None:
            return None
        if self.routes is None:
            raise RuntimeError(
                "a step asks for routed experts, but this engine records none (start it "
                "with enable_return_routed_experts=True)"
            )
        return read_routes(self.routes, plan)

    def _score_prompts(self, out: DecodeOutputs, plan: PromptRows) -> ScoredPrompts | None:
        """Score the step's prompt tokens (``layers/prompt_logprobs.py``) on the rank that
        samples; every rank computes the rows' logits (each joins the LM head's
        all-gather)."""
        if out.logits is not None:  # a replayed graph: one token a row, logits for each
            logits = out.logits

            def rows_logits(index: torch.Tensor) -> torch.Tensor:
                return logits.index_select(0, index)
        else:
            hidden = out.hidden

            def rows_logits(index: torch.Tensor) -> torch.Tensor:
                return self.model.compute_logits(hidden.index_select(0, index), widen=False)

        scored = score_prompts(rows_logits, plan, self.device)
        return scored if self.samples else None

    def _stage_graph_draws(self, step: StepInput, graph: DecodeGraph) -> bool:
        """Fill the graph's sampling buffers for ``step``; whether its tokens are the
        step's draws (a decode step whose every row the graph's sampler serves)."""
        if self.graph_sampling is None:
            return False
        if self.graphs.graph_end != "tokens" or not all(step.sample):
            self.graph_sampling.count_rows(0)  # checked after the replay
            return False
        return self.graph_sampling.stage(
            step.sampling,
            lambda: row_keys(step.sampling, step.seq_id, self.sampler.seed),
            step.num_output_tokens,
            rows=graph.batch_size,
        )

    def before_capture(self) -> None:
        """Called before the decode graphs are (re)captured: a capture's forwards (the
        warmup, the audit's probes, the CPU stand-in's) count no non-finite row."""
        if self.graph_sampling is not None:
            self.graph_sampling.count_rows(0)

    def decode_outputs(self, num_rows: int, ctx: ForwardContext) -> DecodeOutputs:
        """What a decode graph captures: the forward, then (unless ``graph_end`` says
        otherwise) the logits and, on the rank that samples, the tokens and (unless
        :attr:`nonfinite_check` says otherwise) their non-finite check.

        Also the body of the CPU's stand-in graphs (``graphs.py``), which run it
        eagerly at every replay: the captured path is the one CPU tests exercise."""
        hidden = self._forward_rows(num_rows, ctx)
        graph_end = self.graphs.graph_end
        if graph_end == "hidden":
            return DecodeOutputs(hidden, None, None, None)
        logits = self.model.compute_logits(hidden, widen=False)
        if graph_end == "logits" or self.graph_sampling is None:
            return DecodeOutputs(None, logits, None, None)
        if self.nonfinite_check != "graph":
            return DecodeOutputs(None, logits, *self.graph_sampling.sample(logits))
        return DecodeOutputs(
            None, logits, *self.graph_sampling.sample_checked(logits, self._nan_rows)
        )
