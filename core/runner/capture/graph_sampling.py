"""The end of a decode graph: the logits, and the sampler's common rows.

A decode graph captures the forward and, after it, the logits of its padded batch
(``compute_logits``, with its tensor-parallel gather), so no launch between the last
layer and the logits is host work. On the rank that samples it goes on: each row's
maximum and argmax (a greedy row's token), then one
launch that overwrites the token of every row at a temperature above 0 with its
keyed draw (:func:`~kvrunner.layers.fused.gumbel_argmax_triton.gumbel_argmax_into_`:
the kernel, noise and key the eager sampler uses for those rows), then the
non-finite check on the maxima (:func:`~kvrunner.layers.nonfinite_rows.mark_nonfinite_into`):
the tokens the host reads, with each non-finite row's token replaced by its cause's
code, and the step's count raised by its real rows' non-finite ones. The drawn tokens
stay beside the coded ones: the next step's placeholders feed them.

The rows' temperatures, keys (a request's seed, or the engine's key for an unseeded
request) and token counts live in buffers a step fills before its replay
(:meth:`GraphSampling.stage`: two pinned uploads, none while every row stays greedy),
and so does the number of rows the check counts (the step's rows when the graph draws
it, else 0; one 8-byte upload when it changes), so the graph holds no Python value of
any step.

A step is drawn in the graph when no row filters by top-k / top-p and no row has
logit rules (vLLM's penalties and masks, ``SamplingColumns.rules``): the rows the
one-pass kernel serves eagerly too, with the same keys, so the tokens are the same.
A step with a top-k / top-p row (a sort), a row with rules or a row under a
structured-output constraint (``SamplingColumns.masks``; greedy rows too: rules and
masks change their argmax) is sampled eagerly from the graph's logits, and checked
after the replay as an eager step is; the graph's own tokens are ignored. Logprobs
(in the engine's ``logprobs_mode``, processed ones included) and kept masses are
computed after the replay either way, from the graph's logits and tokens, by the
sampler's own code (``layers/logprobs_mode.py``).

``[capture] decode_graph_ends_at`` says where the graph ends: ``tokens`` (default),
``logits``, or ``hidden`` (the forward alone, the sampler and logits eager), for
measuring what each part saves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from kvrunner.engine.step_io import SamplingColumns
from kvrunner.layers.fused.dispatch import fused_sampler_enabled, use_triton
from kvrunner.layers.nonfinite_rows import mark_nonfinite_into
from kvrunner.layers.sampling_draw import fused_draw_serves
from kvrunner.plugin_api.buffers import upload_into


class DecodeOutputs(NamedTuple):
    """What a decode graph leaves for its padded batch; the parts it did not compute
    are ``None``."""

    hidden: torch.Tensor | None  # [B, hidden]: only when the graph ends at the forward
    logits: torch.Tensor | None  # [B, vocab] in the model dtype
    tokens: torch.Tensor | None  # [B] int64: argmax, or the keyed draw above T = 0
    row_max: torch.Tensor | None  # [B]: each row's largest logit (NaN where it holds one)
    #: [B] int64: ``tokens`` with each non-finite row's cause code, when the graph
    #: checks them (else the step is checked after the replay)
    coded: torch.Tensor | None = None


class GraphSampling:
    """The sampling buffers one runner's decode graphs read, and the captured draw.

    :param max_batch: the largest graph's batch.
    :param vocab: the logits' width (a top-k of at least this filters nothing).
    """

    def __init__(self, max_batch: int, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        probe = torch.empty(0, device=device)
        #: whether the graph draws keyed rows (the one-pass kernel's path), else greedy
        #: rows only; fixed when the runner is built, as the graphs are
        self.draws = use_triton(probe) and fused_sampler_enabled()
        self.temperatures = torch.zeros(max_batch, dtype=torch.float32, device=device)
        self.keys = torch.zeros(2, max_batch, dtype=torch.int64, device=device)  # key, count
        self._any_drawing = False  # a temperature above 0 is in the buffers
        #: how many leading rows the captured check counts in the next replay: the
        #: step's rows when the graph draws it, else 0 (a step checked after the
        #: replay, a capture), so no row is counted twice and no padded row at all
        self.counted_rows = torch.zeros(1, dtype=torch.int64, device=device)
        self._counted_host = 0  # what counted_rows holds: uploaded only on a change
        self.row_index = torch.arange(max_batch, dtype=torch.int64, device=device)

    def sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Captured after the logits: every row's token and raw maximum."""
        row_max, tokens = logits.max(dim=-1)  # as the eager sampler picks greedy rows
        if self.draws:
            from kvrunner.layers.fused.gumbel_argmax_triton import gumbel_argmax_into_

            rows = logits.shape[0]
            gumbel_argmax_into_(
                tokens, logits, self.temperatures[:rows], self.keys[0, :rows], self.keys[1, :rows]
            )
        return tokens, row_max

    def sample_checked(
        self, logits: torch.Tensor, count: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Captured after the logits: :meth:`sample`, then the non-finite check; every
        row's drawn token, raw maximum and coded token, with ``count`` (0-d int64)
        raised by the non-finite rows among the first :attr:`counted_rows`."""
        tokens, row_max = self.sample(logits)
        coded = mark_nonfinite_into(
            count, tokens, row_max, row_index=self.row_index, counted_rows=self.counted_rows
        )
        return tokens, row_max, coded

    def count_rows(self, rows: int) -> None:
        """Stage how many leading rows the next replay's check counts."""
        if rows != self._counted_host:
            upload_into(self.counted_rows, [rows])
            self._counted_host = rows

    def stage(
        self,
        sampling: SamplingColumns,
        keys: Callable[[], np.ndarray | Sequence[int]],
        num_generated: Sequence[int],
        *,
        rows: int,
    ) -> bool:
        """Fill the buffers for a replay over ``rows`` padded rows whose first
        ``len(sampling)`` are these, keyed by ``keys()`` (``sampling_seeds.row_keys``,
        asked only for a step the graph draws); returns whether the graph draws them
        (else the step samples eagerly, and the graph's draws, all greedy then, are
        ignored). The uploads come straight from the columns."""
        n = len(sampling)
        greedy = np.count_nonzero(sampling.temperature) == 0  # no row draws
        served = not sampling.adjusted and (greedy or self.draws and bool(
            (~sampling.drawing | fused_draw_serves(sampling, self.vocab, keyed=True)).all()
        ))
        self.count_rows(n if served else 0)
        if greedy or not served:
            if self._any_drawing:  # a previous step's temperatures would draw again
                self.temperatures.zero_()
                self._any_drawing = False
            return served
        temperatures = np.zeros(rows)  # padded rows stay greedy
        temperatures[:n] = sampling.temperature
        upload_into(self.temperatures[:rows], temperatures)
        keyed = np.zeros((2, rows), np.int64)  # key, count
        keyed[0, :n] = keys()
        keyed[1, :n] = num_generated
        upload_into(self.keys[:, :rows], keyed)
        self._any_drawing = True
        return True
