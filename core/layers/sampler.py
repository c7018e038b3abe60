"""Pick the next token for every row of a logits batch, and report logprobs.

Per row, in order: greedy rows (``temperature == 0``) take the argmax of the raw
logits. Other rows divide by the temperature, keep the ``top_k`` largest, keep the
smallest most-likely set whose probability reaches ``top_p`` (renormalized after
top-k, as vLLM does), and draw with the Gumbel-max trick: ``argmax(logits + G)``
with ``G`` standard Gumbel noise is an exact draw from ``softmax(logits)``, and
filtered tokens at ``-inf`` can never win.

Reproducibility: a request with ``seed`` draws its noise from a generator keyed
by ``(seed, tokens generated so far)``, so its tokens do not depend on which other
requests share the batch, on the batch order, or on preemption and recompute (on
CUDA one Triton launch of a counter-based generator keyed by ``(seed, count)`` serves
every seeded row; without Triton, torch's generator re-seeded per row with
:func:`step_seed`: the two paths draw different noise).
The engine's sampler (:class:`Sampler`, which knows each row's request id) keys an
unseeded request the same way, by a key mixed from the engine's seed and the request
id (``sampling_seeds.request_keys``): its draws are its own too, the same with
asynchronous steps or without, drawn by the same kernel as seeded rows (in the decode
graph where it ends with the tokens), and one engine seed repeats them. Rows that
:func:`sample` is given no key for share one generator.

Rows with vLLM's logit adjustments (``SamplingColumns.rules``: penalties, ``min_p``,
``min_tokens``, ``logit_bias``, ``allowed_token_ids``, bad words) are picked from a
float32 copy of the logits adjusted by ``layers/logit_processing.py``, greedy rows
included; ``min_p`` masks a drawing row after its temperature, so such a row takes
the torch draw. The penalties read the token history the :class:`Sampler` keeps on
the device (``layers/token_history.py``), and each drawn token is added to it at once.

Rows under a structured-output constraint (``SamplingColumns.masks``) have every token
their grammar forbids set to -inf before anything else (``layers/token_mask.py``): for
such a row the masked logits are its raw logits, for the pick and for every logprob
reported, as in vLLM, where the grammar's bitmask is applied to the logits the sampler
is given.

Logprobs are by default ``log_softmax`` of the *raw* logits (before penalties,
temperature and filtering), vLLM's default ``logprobs_mode`` of ``raw_logprobs`` and
what an RL trainer's plain forward computes; the engine's ``logprobs_mode`` may ask for
the raw logits, or the processed logits or logprobs the token was drawn from, and a
row may ask for its kept mass (``layers/logprobs_mode.py``). Every mode is computed
here, after the tokens are chosen, from the logits they were chosen from: the same
for a row the decode graph drew as for one drawn eagerly.

Per-row settings come as the rows' :class:`~kvrunner.engine.step_io.SamplingColumns`
(the engine's columns, as a step carries them), read as arrays. No host sync: they
reach the device through pinned, non-blocking copies straight from those arrays, and
nothing is read back here. The tokens stay on the device (the next step can feed
them there, see ``runner/step/launched_step.py``); :func:`to_packed` reads them.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch

from kvrunner.engine.step_io import (
    PackedSampled,
    SamplingColumns,
    StepInput,
    as_sampling_columns,
)
from kvrunner.layers.logit_processing import adjusted_logits
from kvrunner.layers.logprobs_mode import check_logprobs_mode, reads_processed, reported_values
from kvrunner.layers.sampling_draw import draw_rows
from kvrunner.layers.sampling_seeds import row_keys
from kvrunner.layers.token_history import TokenHistory
from kvrunner.layers.token_mask import masked_logits
from kvrunner.plugin_api.buffers import on_device
from kvrunner.sampling_params import SamplingParams


@attrs.frozen(kw_only=True)
class SamplerOutput:
    """What :func:`sample` picked, with logprobs.

    ``top_ids`` / ``top_logprobs`` are ``[N, K]`` (most likely first) with ``K`` the
    largest ``logprobs`` any row asked for, or ``None`` when no row asked; row ``i``
    reports its first ``num_top[i]`` columns. Logprobs are what the engine's
    ``logprobs_mode`` reports (``layers/logprobs_mode.py``).
    """

    token_ids: torch.Tensor  # [N] long
    #: [N] float32, the sampled token's logprob; None when no row asked for logprobs
    logprobs: torch.Tensor | None
    #: [N] in the logits' dtype, each row's largest raw logit: NaN exactly where the
    #: row holds a NaN
    row_max: torch.Tensor
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    num_top: tuple[int, ...]
    #: [N] float32, each row's kept mass; None when no row asked for it
    kept_mass: torch.Tensor | None = None

    def top_logprobs_dict(self, row: int) -> dict[int, float] | None:
        """``{token_id: logprob}`` of the ``num_top[row]`` most likely tokens, or ``None``."""
        n = self.num_top[row]
        if n == 0 or self.top_ids is None:
            return None
        ids = self.top_ids[row, :n].tolist()
        return dict(zip(ids, self.top_logprobs[row, :n].tolist(), strict=True))


def sample(
    logits: torch.Tensor,
    sampling: SamplingColumns | Sequence[SamplingParams],
    num_generated: Sequence[int] | np.ndarray,
    *,
    generator: torch.Generator | None = None,
    keys: Sequence[int] | np.ndarray | None = None,
    history: TokenHistory | None = None,
    logprobs_mode: str = "raw_logprobs",
) -> SamplerOutput:
    """Sample one token per row.

    :param logits: ``[N, V]`` raw logits, any float dtype: every value is read as its
        float32 widening (exact), and only the rows and passes that need float32 are
        widened (a bf16 batch of greedy rows is never copied).
    :param sampling: the rows' sampling columns (a list of one :class:`SamplingParams`
        per row is converted: tests and tools list them).
    :param num_generated: tokens each row's request has generated so far (keys seeds).
    :param generator: for rows without a seed; ``None`` uses torch's default generator.
        Must live on ``logits.device``.
    :param keys: each row's int64 draw key (``sampling_seeds.row_keys``); then no row
        reads ``generator``.
    :param history: the token history the rows' rules read (and each drawn token of
        a row with a history row is added to).
    :param logprobs_mode: what the logprobs are (``layers/logprobs_mode.py``).
    """
    sampling = as_sampling_columns(sampling)
    n, vocab = logits.shape
    if not len(sampling) == len(num_generated) == n:
        raise ValueError(
            f"sample: {n} logit rows but {len(sampling)} sampling rows and "
            f"{len(num_generated)} counts"
        )
    # max, not argmax: the same first-maximum index, and the values tell NaN rows
    # apart (max propagates NaN) without another pass over the logits. In the logits'
    # own dtype: widening is exact and keeps order, so the maximum and its index are
    # those of the float32 values.
    model_logits = logits
    if sampling.masks is not None:
        logits = masked_logits(logits, sampling.masks)
    raw = logits
    if sampling.rules is not None:
        logits = adjusted_logits(raw, sampling.rules, np.asarray(num_generated), history)
    row_max, tokens = logits.max(dim=-1)
    if logits is not model_logits:
        # A non-finite raw row stays one (a mask must not hide a NaN); a row whose
        # rules or grammar mask every token has nothing to sample (-inf), as an all
        # -inf row.
        raw_max = model_logits.max(dim=-1).values.to(row_max.dtype)
        row_max = torch.where(raw_max.isnan() | (raw_max == float("inf")), raw_max, row_max)
    num_drawing = np.count_nonzero(sampling.temperature)  # rows that are not greedy
    truncated = None
    if num_drawing:
        keys = None if keys is None else np.asarray(keys, np.int64)
        # the processed values are the drawn rows' truncated logits: kept, not redone
        keep = reads_processed(sampling, logprobs_mode)
        if num_drawing == n:  # a sampling rollout's steps: no row gather
            tokens, truncated = draw_rows(logits, None, sampling, num_generated, generator,
                                          keys, keep_truncated=keep)  # fmt: skip
        else:
            index = np.flatnonzero(sampling.drawing)
            rows = on_device(index, torch.int64, logits.device)
            tokens[rows], truncated = draw_rows(
                logits, rows, sampling.take(index), np.asarray(num_generated, np.int64)[index],
                generator, None if keys is None else keys[index], keep_truncated=keep)
    # Before the history takes this step's tokens: the processed logprobs are those
    # of the logits the tokens were drawn from.
    out = with_logprobs(raw, tokens, row_max, sampling, mode=logprobs_mode,
                        adjusted=None if logits is raw else logits,
                        truncated=truncated)  # fmt: skip
    if history is not None and sampling.rules is not None:
        _record(history, sampling, tokens)
    return out


def _record(history: TokenHistory, sampling: SamplingColumns, tokens: torch.Tensor) -> None:
    """Add each row's token to its history row, for the rows that have one."""
    rows = [(i, r.history_row) for i, r in enumerate(sampling.rules)
            if r is not None and r.history_row >= 0]  # fmt: skip
    if rows:
        index = on_device(np.array(rows, np.int64).T, torch.int64, tokens.device)
        history.record(index[1], tokens.index_select(0, index[0]))


def with_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    row_max: torch.Tensor,
    sampling: SamplingColumns,
    *,
    mode: str = "raw_logprobs",
    adjusted: torch.Tensor | None = None,
    truncated: torch.Tensor | None = None,
) -> SamplerOutput:
    """The :class:`SamplerOutput` of rows whose ``tokens`` (and raw ``row_max``) are
    chosen: the logprobs the rows ask for (``sampling.logprobs``) as ``mode`` reports
    them from the raw ``logits`` (and the rule-``adjusted`` ones, where the step has
    rules; ``truncated``: the drawing rows' truncated logits, where the draw kept
    them), and the kept masses the rows ask for. Also for tokens a decode graph drew
    (``runner/capture/graph_sampling.py``)."""
    n, vocab = logits.shape
    asked = sampling.logprobs  # -1: none
    most = int(asked.max(initial=-1))  # one pass: whether any row asks, and for tops
    num_top = tuple(np.minimum(asked.clip(min=0), vocab).tolist()) if most > 0 else (0,) * n
    token_logprobs = top_ids = top_values = None
    wants_mass = bool(sampling.kept_mass.any())
    # A [N, V] log_softmax is the sampler's largest pass: only when a row asks.
    values, mass = None, None
    if most >= 0 or wants_mass:
        values, mass = reported_values(logits, sampling, mode, adjusted=adjusted,
                                       truncated=truncated, values=most >= 0,
                                       with_mass=wants_mass)  # fmt: skip
    if values is not None:
        token_logprobs = values.gather(1, tokens[:, None]).squeeze(1)
        if most > 0:
            top_values, top_ids = values.topk(min(most, vocab), dim=-1)
    return SamplerOutput(
        token_ids=tokens,
        row_max=row_max,
        logprobs=token_logprobs,
        top_ids=top_ids,
        top_logprobs=top_values,
        num_top=num_top,
        kept_mass=mass,
    )


def to_packed(
    out: SamplerOutput, seq_ids: list[int], sampling: SamplingColumns
) -> PackedSampled:
    """The sampled tokens as columns; logprobs only where the request asked."""
    tokens = out.token_ids.tolist()
    mass = None
    if out.kept_mass is not None:
        mass = [m if w else None for m, w in zip(out.kept_mass.tolist(),
                                                 sampling.kept_mass.tolist(), strict=True)]
    if out.logprobs is None:  # no row asked: no per-row pass
        return seq_ids, tokens, [None] * len(tokens), [None] * len(tokens), None, mass, None
    wants = (sampling.logprobs >= 0).tolist()
    logprobs = out.logprobs.tolist()
    return (
        seq_ids,
        tokens,
        [lp if w else None for lp, w in zip(logprobs, wants, strict=True)],
        [out.top_logprobs_dict(row) if w else None for row, w in enumerate(wants)],
        None,
        mass,
        None,
    )


@attrs.frozen(kw_only=True)
class StepSamples:
    """A step's draws, still on the device, with the rows they belong to."""

    out: SamplerOutput
    seq_ids: list[int]
    #: the sampled rows' sampling columns (what logprobs each asked for)
    sampling: SamplingColumns

    def packed(self) -> PackedSampled:
        """The draws as columns (reading them waits for the device)."""
        return to_packed(self.out, self.seq_ids, self.sampling)


def sample_step_rows(
    logits: torch.Tensor,
    step: StepInput,
    *,
    generator: torch.Generator | None = None,
    drawn: tuple[torch.Tensor, torch.Tensor] | None = None,
    engine_seed: int | None = None,
    history: TokenHistory | None = None,
    logprobs_mode: str = "raw_logprobs",
) -> StepSamples:
    """:func:`sample` for the step's sampling chunks; row ``i`` of ``logits`` is the
    ``i``-th chunk with ``sample`` set. Nothing is read back to the host.

    ``drawn``: the rows' tokens and raw row maxima, already chosen on the device (by a
    decode graph); then only the logprobs are computed here. ``engine_seed``: key the
    unseeded rows by it and their request ids (else they draw from ``generator``).
    ``history``: the token history of the rows' rules (:func:`sample`).
    ``logprobs_mode``: what the logprobs are (``layers/logprobs_mode.py``), the same
    whether the rows were drawn here or in a graph.
    """
    if all(step.sample):  # every decode step: the columns themselves, no index passes
        sampling, counts, seq_ids = step.sampling, step.num_output_tokens, list(step.seq_id)
    else:
        rows = [i for i, wants in enumerate(step.sample) if wants]
        sampling = step.sampling.take(rows)
        counts = [step.num_output_tokens[i] for i in rows]
        seq_ids = [step.seq_id[i] for i in rows]
    if drawn is None:
        keys = None if engine_seed is None else row_keys(sampling, seq_ids, engine_seed)
        out = sample(logits, sampling, counts, generator=generator, keys=keys, history=history,
                     logprobs_mode=logprobs_mode)
    elif sampling.adjusted:
        raise ValueError("a step with logit rules or token masks is sampled eagerly, not "
                         "drawn in a graph")
    else:
        out = with_logprobs(logits, *drawn, sampling, mode=logprobs_mode)
    return StepSamples(out=out, seq_ids=seq_ids, sampling=sampling)


class Sampler:
    """The engine's sampler: a step's unseeded rows are keyed by ``seed`` and their
    request ids (:meth:`sample_step_rows`), so two engines built with the same seed
    draw the same unseeded tokens; every row's logprobs are what ``logprobs_mode``
    reports (the engine's ``logprobs_mode``).

    Called on bare rows (no request ids), unseeded rows draw from a generator created
    on the first call's device and seeded with ``seed``.

    It keeps the token history of the requests whose logit rules read it
    (:attr:`history`, made by the first step that starts one).
    """

    def __init__(self, seed: int = 0, logprobs_mode: str = "raw_logprobs") -> None:
        self.seed = seed
        #: what every row's logprobs are (``layers/logprobs_mode.py``)
        self.logprobs_mode = check_logprobs_mode(logprobs_mode)
        self._generator: torch.Generator | None = None
        #: the penalised requests' tokens on the device (``layers/token_history.py``)
        self.history: TokenHistory | None = None

    def start_histories(self, step: StepInput, vocab: int, device: torch.device) -> None:
        """Restart the token histories ``step`` starts (``StepInput.history_init``); call
        for every step, before it samples, on the rank that samples."""
        if not step.history_init:
            return
        if self.history is None:
            self.history = TokenHistory(vocab, device)
        self.history.start(step.history_init)

    def __call__(
        self,
        logits: torch.Tensor,
        sampling: SamplingColumns | Sequence[SamplingParams],
        num_generated: Sequence[int],
    ) -> SamplerOutput:
        return sample(logits, sampling, num_generated,
                      generator=self._generator_for(logits.device),
                      logprobs_mode=self.logprobs_mode)  # fmt: skip

    def sample_step_rows(
        self,
        logits: torch.Tensor,
        step: StepInput,
        *,
        drawn: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> StepSamples:
        """:func:`sample_step_rows`, unseeded rows keyed by this sampler's seed, the rows'
        rules reading this sampler's token history."""
        return sample_step_rows(logits, step, drawn=drawn, engine_seed=self.seed,
                                history=self.history,
                                logprobs_mode=self.logprobs_mode)  # fmt: skip

    def _generator_for(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator
