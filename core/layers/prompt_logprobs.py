"""Prompt logprobs: each prompt token's logprob given the tokens before it, scored in
the prefill that computes the prompt (``SamplingParams.prompt_logprobs``).

A chunk feeding positions ``p .. p+n-1`` of a prompt predicts, at each position, the
token after it; while that token is a prompt token the engine names it in the step's
``prompt_targets`` column, so a chunk scores the tokens at ``p+1 .. p+n`` (the last of
them is the next chunk's first token, which the engine knows). The logits of those
rows go through the very ``log_softmax`` the sampler reports generation's logprobs
with (``layers/sampler.py``), so in deterministic mode a response scored as a prompt
gets the logprobs its generation returned, bit for bit.

Rows are scored in blocks of :data:`ROWS_PER_PASS`: a chunk of thousands of tokens
would otherwise hold a float32 ``[tokens, vocabulary]`` matrix at once.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from kvrunner.engine.step_io import PromptScores, StepInput
from kvrunner.plugin_api.buffers import on_device

#: logits rows widened to float32 at once while scoring a prompt chunk
ROWS_PER_PASS = 256


@attrs.frozen(kw_only=True)
class PromptRows:
    """Which token rows of a step score prompt tokens, and which tokens.

    ``rows[j]`` is a row of the step's flat token batch and ``targets[j]`` the prompt
    token its logits score. Chunk ``i`` (``seq_ids[i]``) owns ``counts[i]``
    consecutive entries, scoring prompt indices from ``firsts[i]`` on, with
    ``num_top[i]`` top logprobs each.
    """

    seq_ids: list[int]
    firsts: list[int]
    counts: list[int]
    num_top: list[int]
    rows: list[int]
    targets: list[int]


def prompt_rows(step: StepInput) -> PromptRows | None:
    """The rows ``step`` scores for its prompt-logprob requests; None when it scores none."""
    if step.prompt_targets is None:
        return None
    seq_ids: list[int] = []
    firsts: list[int] = []
    counts: list[int] = []
    num_top: list[int] = []
    rows: list[int] = []
    targets: list[int] = []
    offset = 0
    for seq_id, tokens, start, wanted, top in zip(
        step.seq_id, step.token_ids, step.start_pos, step.prompt_targets,
        step.sampling.prompt_logprobs.tolist(), strict=True,
    ):
        if wanted:
            if len(wanted) > len(tokens):
                raise ValueError(f"sequence {seq_id}: {len(wanted)} prompt targets for a "
                                 f"chunk of {len(tokens)} tokens")
            seq_ids.append(seq_id)
            firsts.append(start + 1)
            counts.append(len(wanted))
            num_top.append(max(top, 0))  # -1 (no prompt_logprobs asked): no top logprobs
            rows.extend(range(offset, offset + len(wanted)))
            targets.extend(wanted)
        offset += len(tokens)
    if not rows:
        return None
    return PromptRows(seq_ids=seq_ids, firsts=firsts, counts=counts, num_top=num_top,
                      rows=rows, targets=targets)


@attrs.frozen(kw_only=True)
class ScoredPrompts:
    """A step's prompt scores, on the device until :meth:`to_host` and :meth:`packed`."""

    plan: PromptRows
    logprobs: torch.Tensor  #: [R] float32, each target's logprob
    #: [R] int64, each target's rank in its row (1: the likeliest; ties share the best)
    ranks: torch.Tensor
    top_values: torch.Tensor | None  #: [R, K] float32 (K the largest ``num_top``), or None
    top_ids: torch.Tensor | None  #: [R, K] int64

    def to_host(self) -> ScoredPrompts:
        """The same scores with non-blocking copies to the host queued (CUDA)."""
        return attrs.evolve(self, **{
            name: getattr(self, name).to("cpu", non_blocking=True)
            for name in ("logprobs", "ranks", "top_values", "top_ids")
            if getattr(self, name) is not None
        })

    def packed(self) -> dict[int, PromptScores]:
        """``{seq_id: (first prompt index, logprobs, top dicts)}`` (reads the device)."""
        plan = self.plan
        logprobs = self.logprobs.tolist()
        ranks = self.ranks.tolist()
        values = self.top_values.tolist() if self.top_values is not None else None
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        out: dict[int, PromptScores] = {}
        at = 0
        for seq_id, first, count, k in zip(plan.seq_ids, plan.firsts, plan.counts, plan.num_top,
                                           strict=True):
            tops: list[dict[int, float] | None] = [None] * count
            if k and values is not None:
                tops = [dict(zip(ids[r][:k], values[r][:k], strict=True))
                        for r in range(at, at + count)]
            out[seq_id] = (first, logprobs[at : at + count], tops, ranks[at : at + count])
            at += count
        return out


def score_prompts(
    rows_logits: Callable[[torch.Tensor], torch.Tensor], plan: PromptRows, device: torch.device
) -> ScoredPrompts:
    """Score ``plan``'s targets: ``rows_logits(index)`` gives the raw logits ``[r, V]``
    of the token rows ``index`` (int64, on ``device``). Nothing is read back here."""
    index = on_device(plan.rows, torch.int64, device)
    targets = on_device(plan.targets, torch.int64, device)
    k = max(plan.num_top)
    logprobs, ranks, values, ids = [], [], [], []
    for lo in range(0, len(plan.rows), ROWS_PER_PASS):
        logits = rows_logits(index[lo : lo + ROWS_PER_PASS])
        # The sampler's own call (layers/sampler.py with_logprobs): the same bits.
        all_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        scored = all_logprobs.gather(1, targets[lo : lo + ROWS_PER_PASS, None])
        logprobs.append(scored.squeeze(1))
        # vLLM's rank: 1 + the tokens strictly likelier than the target
        ranks.append((all_logprobs > scored).sum(dim=-1) + 1)
        if k:
            top = all_logprobs.topk(k, dim=-1)
            values.append(top.values)
            ids.append(top.indices)
    return ScoredPrompts(
        plan=plan,
        logprobs=torch.cat(logprobs),
        ranks=torch.cat(ranks),
        top_values=torch.cat(values) if k else None,
        top_ids=torch.cat(ids) if k else None,
    )

