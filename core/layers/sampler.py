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
Requests without a seed share one generator (the engine's).

Logprobs are ``log_softmax`` of the *raw* logits (before temperature and
filtering), which is what vLLM reports by default and what an RL trainer compares
against its own forward pass.

No host sync: per-row settings reach the device through pinned, non-blocking copies,
and nothing is read back here. The tokens stay on the device (the next step can feed
them there, see ``runner/launched_step.py``); :func:`to_packed` reads them.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from kvrunner.batch import PackedSampled, StepInput
from kvrunner.buffers import on_device
from kvrunner.layers.fused.dispatch import fused_sampler_enabled, use_triton
from kvrunner.layers.sampling_seeds import int64_seed, step_seed
from kvrunner.sampling_params import SamplingParams


@attrs.frozen(kw_only=True)
class SamplerOutput:
    """What :func:`sample` picked, with logprobs.

    ``top_ids`` / ``top_logprobs`` are ``[N, K]`` (most likely first) with ``K`` the
    largest ``logprobs`` any row asked for, or ``None`` when no row asked; row ``i``
    reports its first ``num_top[i]`` columns.
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

    def top_logprobs_dict(self, row: int) -> dict[int, float] | None:
        """``{token_id: logprob}`` of the ``num_top[row]`` most likely tokens, or ``None``."""
        n = self.num_top[row]
        if n == 0 or self.top_ids is None:
            return None
        ids = self.top_ids[row, :n].tolist()
        return dict(zip(ids, self.top_logprobs[row, :n].tolist(), strict=True))


def _filter(scaled: torch.Tensor, raw: torch.Tensor, top_ks: list[int],
            top_ps: list[float]) -> torch.Tensor:
    """Set every logit outside each row's top-k set / top-p nucleus to ``-inf``. The
    ranking is ``raw``'s (the logits before the temperature): dividing keeps the order
    but may merge two logits (a subnormal halved to zero), ranking a lower one first."""
    rows, vocab = scaled.shape
    ks = [k if 0 < k < vocab else vocab for k in top_ks]
    if all(k == vocab for k in ks) and all(p >= 1.0 for p in top_ps):
        return scaled
    device = scaled.device
    # Stable sort: among equal logits the lower token id ranks first, as argmax does.
    order = raw.sort(dim=-1, descending=True, stable=True).indices
    values = scaled.gather(-1, order)  # non-increasing, as the scaling keeps order
    rank = torch.arange(vocab, device=device)
    values = values.masked_fill(rank >= on_device(ks, torch.int64, device)[:, None], float("-inf"))
    if any(p < 1.0 for p in top_ps):
        probs = values.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # A disabled row gets a threshold no mass reaches: its cumsum may round past 1.
        ps = on_device([p if p < 1.0 else 2.0 for p in top_ps], torch.float32, device)
        values = values.masked_fill(mass_before >= ps[:, None], float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, values)


def _gumbel(
    rows: int,
    vocab: int,
    seeds: list[int | None],
    counts: list[int],
    generator: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    """``[rows, vocab]`` standard Gumbel noise; a seeded row's noise depends only on
    its ``(seed, count)`` (and the vocabulary size and device)."""
    u = torch.empty(rows, vocab, device=device)
    unseeded = [i for i, s in enumerate(seeds) if s is None]
    if len(unseeded) == rows:
        u.uniform_(generator=generator)  # the same draws as torch.rand, with no index
    elif unseeded:
        u[on_device(unseeded, torch.int64, device)] = torch.rand(
            len(unseeded), vocab, generator=generator, device=device
        )
    seeded = [i for i, s in enumerate(seeds) if s is not None]
    if seeded and use_triton(u):
        from kvrunner.layers.fused.seeded_uniform_triton import seeded_uniform_

        # One launch of a counter-based generator for every seeded row, keyed on the
        # device: no per-row hashing here.
        seeded_uniform_(
            u,
            on_device(seeded, torch.int64, device),
            on_device([int64_seed(seeds[i]) for i in seeded], torch.int64, device),
            on_device([counts[i] for i in seeded], torch.int64, device),
        )
    elif seeded:
        # Without Triton: one generator re-seeded per row.
        g = torch.Generator(device=device)
        for i in seeded:
            g.manual_seed(step_seed(seeds[i], counts[i]))
            u[i].uniform_(generator=g)
    # Keep u strictly inside (0, 1) so both logs are finite: an infinite noise value
    # could lift a filtered (-inf) token to NaN and NaN wins argmax.
    eps = torch.finfo(u.dtype).eps
    u.clamp_(min=torch.finfo(u.dtype).tiny, max=1.0 - eps)
    return u.log_().neg_().log_().neg_()  # -log(-log(u)), in place: no [N, V] temporaries


def _draw(
    logits: torch.Tensor,
    rows: torch.Tensor | None,
    params: list[SamplingParams],
    counts: list[int],
    generator: torch.Generator | None,
) -> torch.Tensor:
    """The tokens drawn for ``logits``' ``rows`` (every row when ``None``), row ``i``
    with ``params[i]`` after ``counts[i]`` generated tokens: ``argmax(logits / T + G)``
    over the filtered logits, ``G`` Gumbel noise."""
    device, vocab = logits.device, logits.shape[1]
    temps = on_device([p.temperature for p in params], torch.float32, device)
    if use_fused_draw(logits, params):
        from kvrunner.layers.fused.gumbel_argmax_triton import gumbel_argmax

        # seeds and counts (and every row's id, when no rows were given) in one upload:
        # each upload is a pinned copy and a launch
        cols = [[int64_seed(p.seed) for p in params], counts]
        if rows is None:
            rows, *cols = on_device([list(range(len(params))), *cols], torch.int64, device)
        else:
            cols = on_device(cols, torch.int64, device)
        return gumbel_argmax(logits, rows, temps, cols[0], cols[1])
    raw = logits if rows is None else logits[rows]
    scaled = raw / temps[:, None]  # dividing by float32 temperatures widens in this pass
    scaled = _filter(scaled, raw, [p.top_k for p in params], [p.top_p for p in params])
    noise = _gumbel(len(params), vocab, [p.seed for p in params], counts, generator, device)
    return scaled.add_(noise).argmax(dim=-1)  # scaled is this call's own tensor


def use_fused_draw(logits: torch.Tensor, params: list[SamplingParams]) -> bool:
    """Whether the one-pass kernel draws these rows: not switched off
    (``KVRUNNER_FUSED_SAMPLER=0``), on the Triton path, every row seeded (the kernel
    makes the seeded rows' noise) and none filtered by top-k / top-p (a sort)."""
    vocab = logits.shape[1]
    serves = (p.seed is not None and not 0 < p.top_k < vocab and p.top_p >= 1.0 for p in params)
    return fused_sampler_enabled() and use_triton(logits) and all(serves)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    num_generated: Sequence[int],
    *,
    generator: torch.Generator | None = None,
) -> SamplerOutput:
    """Sample one token per row.

    :param logits: ``[N, V]`` raw logits, any float dtype: every value is read as its
        float32 widening (exact), and only the rows and passes that need float32 are
        widened (a bf16 batch of greedy rows is never copied).
    :param params: one :class:`SamplingParams` per row.
    :param num_generated: tokens each row's request has generated so far (keys seeds).
    :param generator: for rows without a seed; ``None`` uses torch's default generator.
        Must live on ``logits.device``.
    """
    n, vocab = logits.shape
    if not len(params) == len(num_generated) == n:
        raise ValueError(
            f"sample: {n} logit rows but {len(params)} params and {len(num_generated)} counts"
        )
    # max, not argmax: the same first-maximum index, and the values tell NaN rows
    # apart (max propagates NaN) without another pass over the logits. In the logits'
    # own dtype: widening is exact and keeps order, so the maximum and its index are
    # those of the float32 values.
    row_max, tokens = logits.max(dim=-1)
    random_rows = [i for i, p in enumerate(params) if p.temperature != 0.0]  # not greedy
    if random_rows:
        # When every row draws (a sampling rollout's steps), no row gather.
        rows = None if len(random_rows) == n else on_device(random_rows, torch.int64,
                                                              logits.device)
        drawn = _draw(logits, rows, [params[i] for i in random_rows],
                      [num_generated[i] for i in random_rows], generator)
        if rows is None:
            tokens = drawn
        else:
            tokens[rows] = drawn

    asked = [p.logprobs for p in params]
    num_top = tuple(min(n or 0, vocab) for n in asked) if any(asked) else (0,) * n
    token_logprobs = top_ids = top_values = None
    # A [N, V] log_softmax is the sampler's largest pass: only when a row asks.
    if asked.count(None) < n:
        all_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        token_logprobs = all_logprobs.gather(1, tokens[:, None]).squeeze(1)
        if max(num_top, default=0) > 0:
            top_values, top_ids = all_logprobs.topk(max(num_top), dim=-1)
    return SamplerOutput(
        token_ids=tokens,
        row_max=row_max,
        logprobs=token_logprobs,
        top_ids=top_ids,
        top_logprobs=top_values,
        num_top=num_top,
    )


def to_packed(
    out: SamplerOutput, seq_ids: list[int], params: Sequence[SamplingParams]
) -> PackedSampled:
    """The sampled tokens as columns; logprobs only where the request asked."""
    tokens = out.token_ids.tolist()
    if out.logprobs is None:  # no row asked: no per-row pass
        return seq_ids, tokens, [None] * len(tokens), [None] * len(tokens)
    wants = [p.logprobs is not None for p in params]
    logprobs = out.logprobs.tolist()
    return (
        seq_ids,
        tokens,
        [lp if w else None for lp, w in zip(logprobs, wants, strict=True)],
        [out.top_logprobs_dict(row) if w else None for row, w in enumerate(wants)],
    )


@attrs.frozen(kw_only=True)
class StepSamples:
    """A step's draws, still on the device, with the rows they belong to."""

    out: SamplerOutput
    seq_ids: list[int]
    params: list[SamplingParams]

    def packed(self) -> PackedSampled:
        """The draws as columns (reading them waits for the device)."""
        return to_packed(self.out, self.seq_ids, self.params)


def sample_step_rows(
    logits: torch.Tensor, step: StepInput, *, generator: torch.Generator | None = None
) -> StepSamples:
    """:func:`sample` for the step's sampling chunks; row ``i`` of ``logits`` is the
    ``i``-th chunk with ``sample`` set. Nothing is read back to the host."""
    cols = step
    if all(cols.sample):  # every decode step: the columns themselves, no index passes
        params, counts, seq_ids = list(cols.sampling), cols.num_output_tokens, list(cols.seq_id)
    else:
        rows = [i for i, wants in enumerate(cols.sample) if wants]
        params = [cols.sampling[i] for i in rows]
        counts = [cols.num_output_tokens[i] for i in rows]
        seq_ids = [cols.seq_id[i] for i in rows]
    out = sample(logits, params, counts, generator=generator)
    return StepSamples(out=out, seq_ids=seq_ids, params=params)


class Sampler:
    """:func:`sample` with the engine's generator for unseeded requests.

    The generator is created on the first call's device, seeded with ``seed``, so two
    engines built with the same seed draw the same unseeded tokens.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generator: torch.Generator | None = None

    def __call__(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], num_generated: Sequence[int]
    ) -> SamplerOutput:
        return sample(logits, params, num_generated, generator=self._generator_for(logits.device))

    def sample_step_rows(self, logits: torch.Tensor, step: StepInput) -> StepSamples:
        """:func:`sample_step_rows` with this sampler's generator."""
        return sample_step_rows(logits, step, generator=self._generator_for(logits.device))

    def _generator_for(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator
