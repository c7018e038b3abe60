"""One step on one rank, up to its samples on the device (a part of :class:`ModelRunner`).

``launch`` prepares the step, fills its placeholders from the last step's tokens on
the device, replays the decode graph (or runs eagerly), samples on rank 0 and returns
a :class:`~kvrunner.runner.launched_step.LaunchedStep` without waiting for the
device: with asynchronous steps the host schedules the next step meanwhile.
``execute`` is ``launch`` followed by ``result()``.
"""

from __future__ import annotations

import torch

from kvrunner.batch import PackedSampled, StepInput
from kvrunner.buffers import on_device
from kvrunner.runner.graphs import DecodeGraph
from kvrunner.runner.launched_step import DeviceTokens, LaunchedStep, feed_placeholders
from kvrunner.runner.step_batch import prepare_step


class StepLaunch:
    """One step for :class:`~kvrunner.runner.model_runner.ModelRunner`.

    Uses the runner's ``config``, ``device``, ``group``, ``graphs``, ``forward_vars``,
    ``step_builder``, ``backends``, ``model``, ``sampler``, ``samples``,
    ``shares_samples``, ``previous_tokens``, ``_nan_rows`` and ``_forward_rows``.
    """

    def _graph_for(self, step: StepInput) -> DecodeGraph | None:
        if not self.graphs or not step.is_decode:
            return None
        fitting = [bs for bs in self.graphs if bs >= step.num_seqs]
        return self.graphs[min(fitting)] if fitting else None

    def execute(self, step: StepInput) -> PackedSampled:
        """Run one step; its sampled tokens as columns (none on ranks > 0, and none
        for a step whose chunks are all mid-prefill)."""
        return self.launch(step).result()

    @torch.inference_mode()
    def launch(self, step: StepInput) -> LaunchedStep:
        """Run one step up to its samples, leaving them on the device; the host may
        prepare the next step before it reads them (:meth:`LaunchedStep.result`)."""
        graph = self._graph_for(step)
        padded = graph.batch_size if graph is not None else None
        prepared = prepare_step(
            step, block_size=self.config.cache.block_size, num_padded_seqs=padded
        )
        num_tokens = prepared.batch.num_tokens
        rows = padded if padded is not None else num_tokens
        fv = self.forward_vars
        fv["input_ids"][:num_tokens].copy_(prepared.input_ids, non_blocking=True)
        feed_placeholders(fv["input_ids"], step, self.previous_tokens)
        self.previous_tokens = None
        if rows > num_tokens:  # the padded tail of a replayed graph reads token 0 (position 0)
            fv["input_ids"][num_tokens:rows].zero_()
        ctx = self.backends.build_metadata(self.step_builder.fill(prepared.batch))
        if graph is not None:
            hidden = graph.replay()
        else:
            hidden = self._forward_rows(num_tokens, ctx)
        if not prepared.sample_rows:
            return LaunchedStep(None)
        rows = prepared.sample_rows
        if rows[-1] == len(rows) - 1:  # rows 0..n-1, as in every decode step: no index copy
            selected = hidden[: len(rows)]
        else:
            # Through pinned memory: torch.tensor(..., device=cuda) would wait for the
            # step still running, which asynchronous steps exist to overlap.
            selected = hidden.index_select(0, on_device(rows, torch.int64, self.device))
        # every rank joins its all-gather; the sampler widens only what it reads
        logits = self.model.compute_logits(selected, widen=False)
        if not self.samples:
            if self.shares_samples:  # the next step's placeholders need rank 0's draws
                tokens = torch.empty(len(rows), dtype=torch.int64, device=self.device)
                seq_ids = [s for s, wants in zip(step.seq_id, step.sample, strict=True) if wants]
                tokens = self.group.broadcast_from_first(tokens)
                self.previous_tokens = DeviceTokens(seq_ids, tokens)
            return LaunchedStep(None)
        samples = self.sampler.sample_step_rows(logits, step)
        self._nan_rows += torch.isnan(samples.out.row_max).sum()
        tokens = samples.out.token_ids
        if self.shares_samples:
            tokens = self.group.broadcast_from_first(tokens)
        # The sampler already listed the sampled rows' ids: the next step's placeholders.
        self.previous_tokens = DeviceTokens(samples.seq_ids, tokens)
        return LaunchedStep(samples)
