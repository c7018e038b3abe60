"""vLLM's logit adjustments on a batch of logits rows, each row by its own rules.

:func:`adjusted_logits` applies what changes a greedy pick too, in vLLM's order:
``allowed_token_ids`` (every other token to -inf), bad words (a word's last token to
-inf where the output ends with the rest of it), ``min_tokens`` (its stop ids to -inf
while the output is shorter), ``logit_bias`` (added), then the penalties over the
request's token history (``layers/token_history.py``): the repetition penalty divides
a positive logit of a token seen in the prompt or output and multiplies a negative
one, the frequency penalty is subtracted once per time the token is in the output,
the presence penalty once if it is. A row under SGLang's rules
(``penalty_rules="sglang"``) has its frequency and presence penalties subtracted
first, then the repetition penalty over its output's tokens alone, then its
``logit_bias`` added. :func:`mask_min_p_` applies ``min_p`` to a
drawing row after its temperature: a token less likely than ``min_p`` times the
likeliest is masked.

Only rows with rules are touched, and the sampler calls these only for a step that
has any (``SamplingColumns.rules``): the per-row settings are gathered on the host
into a few flat index lists and go up in one pinned upload each; the token history
never comes down.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvrunner.engine.logit_rules import LogitRules
from kvrunner.engine.step_io import SamplingColumns
from kvrunner.layers.token_history import TokenHistory
from kvrunner.plugin_api.buffers import on_device

#: a position of a bad word's padded prefix that compares nothing
_ANY = -2


def adjusted_logits(
    logits: torch.Tensor,
    rules: Sequence[LogitRules | None],
    num_generated: np.ndarray,
    history: TokenHistory | None,
) -> torch.Tensor:
    """A float32 copy of ``logits`` ``[N, V]`` with row ``i`` adjusted by ``rules[i]``
    after ``num_generated[i]`` output tokens (None: left as it is).

    :param history: the token history the rules' ``history_row`` index (needed when a
        row penalises or bans a word of several tokens).
    """
    out = logits.to(torch.float32, copy=True)
    n, vocab = out.shape
    device = out.device
    allowed_rows: list[int] = []
    allowed: list[list[int]] = [[], []]  # local row, token
    masked: list[list[int]] = [[], []]  # row, token: to -inf
    words: list[tuple[int, int, tuple[int, ...]]] = []  # row, history row, word
    bias: list[list[float]] = [[], [], []]  # row, token, bias
    late_bias: list[list[float]] = [[], [], []]  # the same, after the penalties (SGLang)
    penalised: list[tuple[int, int, float, float, float, bool]] = []
    for i, rule in enumerate(rules):
        if rule is None:
            continue
        if rule.allowed_token_ids is not None:
            allowed[0] += [len(allowed_rows)] * len(rule.allowed_token_ids)
            allowed[1] += rule.allowed_token_ids
            allowed_rows.append(i)
        generated = int(num_generated[i])
        for word in rule.bad_words:
            if len(word) == 1:
                masked[0].append(i)
                masked[1].append(word[0])
            elif len(word) - 1 <= generated:  # the output is long enough to end with it
                words.append((i, rule.history_row, word))
        if generated < rule.min_tokens:
            masked[0] += [i] * len(rule.min_tokens_stops)
            masked[1] += rule.min_tokens_stops
        sglang = rule.penalty_rules == "sglang"
        for token, value in rule.logit_bias:
            into = late_bias if sglang else bias
            into[0].append(i)
            into[1].append(token)
            into[2].append(value)
        if rule.penalizes:
            penalised.append((i, rule.history_row, rule.repetition_penalty,
                              rule.presence_penalty, rule.frequency_penalty,
                              sglang))  # fmt: skip
    if allowed_rows:
        rows = on_device(allowed_rows, torch.int64, device)
        at = on_device(allowed, torch.int64, device)
        blocked = torch.ones(len(allowed_rows), vocab, dtype=torch.bool, device=device)
        blocked[at[0], at[1]] = False
        out[rows] = out[rows].masked_fill(blocked, float("-inf"))
    if masked[0]:
        at = on_device(masked, torch.int64, device)
        out[at[0], at[1]] = float("-inf")
    if words:
        _ban_words(out, words, history)
    _add_bias(out, bias)
    if penalised:
        _penalise(out, penalised, history)
    _add_bias(out, late_bias)
    return out


def _add_bias(out: torch.Tensor, bias: list[list[float]]) -> None:
    """Add each (row, token, bias) of the three lists ``bias`` to ``out``."""
    if bias[0]:
        at = on_device(bias[:2], torch.int64, out.device)
        out.index_put_((at[0], at[1]), on_device(bias[2], torch.float32, out.device),
                       accumulate=True)  # fmt: skip


def _ban_words(out: torch.Tensor, words: list[tuple[int, int, tuple[int, ...]]],
               history: TokenHistory | None) -> None:  # fmt: skip
    """Mask each word's last token in its row where the row's latest output tokens are
    the rest of it (compared on the device, in the history's window)."""
    if history is None:
        raise ValueError("bad words of several tokens need the token history")
    width = history.recent.shape[1]
    prefixes = np.full((len(words), width), _ANY, np.int64)
    for k, (_, _, word) in enumerate(words):
        prefixes[k, width - len(word) + 1 :] = word[:-1]
    index = on_device([[r for r, _, _ in words], [h for _, h, _ in words],
                       [w[-1] for _, _, w in words]], torch.int64, out.device)  # fmt: skip
    expected = on_device(prefixes, torch.int64, out.device)
    seen = history.recent.index_select(0, index[1])
    match = ((seen == expected) | (expected == _ANY)).all(dim=-1)
    # Added, not assigned: two words of one row may end in the same token, and an
    # assignment would keep either one's verdict.
    ban = torch.where(match, float("-inf"), 0.0)
    out.index_put_((index[0], index[2]), ban, accumulate=True)


def _penalise(out: torch.Tensor,
              penalised: list[tuple[int, int, float, float, float, bool]],
              history: TokenHistory | None) -> None:  # fmt: skip
    """The repetition, frequency and presence penalties of the ``penalised`` rows (the
    last item of each: SGLang's rules)."""
    if history is None:
        raise ValueError("penalties need the token history")
    device = out.device
    rows, history_rows = on_device([[p[0] for p in penalised], [p[1] for p in penalised]],
                                   torch.int64, device)  # fmt: skip
    repetition, presence, frequency = on_device(
        [[p[2] for p in penalised], [p[3] for p in penalised], [p[4] for p in penalised]],
        torch.float32,
        device,
    )[:, :, None]
    logits = out.index_select(0, rows)
    counts = history.counts.index_select(0, history_rows)
    in_output = counts > 0
    seen = in_output | history.prompt.index_select(0, history_rows)
    scale = torch.where(logits > 0, 1.0 / repetition, repetition)
    vllm = torch.where(seen, logits * scale, logits)
    vllm -= frequency * counts
    vllm -= presence * in_output
    if any(p[5] for p in penalised):
        # SGLang's: the additive penalties first, then the repetition penalty over the
        # output's tokens alone
        sglang = logits - frequency * counts
        sglang -= presence * in_output
        scale = torch.where(sglang > 0, 1.0 / repetition, repetition)
        sglang = torch.where(in_output, sglang * scale, sglang)
        rules = on_device([p[5] for p in penalised], torch.bool, device)
        vllm = torch.where(rules[:, None], sglang, vllm)
    out[rows] = vllm


def min_p_of(sampling: SamplingColumns) -> np.ndarray | None:
    """[N] float64: each row's ``min_p`` (0: off), or None where no row sets one."""
    if sampling.rules is None:
        return None
    min_p = np.array([0.0 if r is None else r.min_p for r in sampling.rules])
    return min_p if min_p.any() else None


def mask_min_p_(scaled: torch.Tensor, min_p: np.ndarray) -> torch.Tensor:
    """Mask, in place, each row's tokens less likely than ``min_p`` times its likeliest
    token's probability (``scaled``: the logits after the temperature); returns it."""
    probs = scaled.softmax(dim=-1)
    threshold = (
        probs.amax(dim=-1, keepdim=True) * on_device(min_p, torch.float32, scaled.device)[:, None]
    )
    return scaled.masked_fill_(probs < threshold, float("-inf"))
