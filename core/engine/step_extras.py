"""What a step brings back beyond each row's token, recorded on its requests: prompt
scores (``SamplingParams.prompt_logprobs``), routed experts
(``return_routed_experts``) and kept masses (``return_kept_mass``).

:class:`StepExtras` knows which unfinished requests ask for the first two (the
scheduler plans a step's extra columns only when one does) and appends what a step
returns to each request's record, keeping what a recomputed position already has.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvrunner.engine.sequence import Sequence
from kvrunner.engine.step_io import PromptScores, SampledTokens, StepRoutes


class StepExtras:
    """The extras of the scheduler's unfinished requests (``unfinished``: its own map)."""

    def __init__(self, unfinished: Mapping[int, Sequence]) -> None:
        self._unfinished = unfinished
        #: unfinished requests that score their prompt
        self._scoring: set[int] = set()
        #: unfinished requests that return their routed experts
        self._routing: set[int] = set()

    @property
    def score_prompts(self) -> bool:
        """Whether a step must carry prompt-scoring columns."""
        return bool(self._scoring)

    @property
    def routes(self) -> bool:
        """Whether a step must carry the routed-experts columns."""
        return bool(self._routing)

    def admit(self, seq: Sequence) -> None:
        """Note what a new request asks for."""
        if seq.sampling_params.prompt_logprobs is not None:
            self._scoring.add(seq.seq_id)
        if seq.sampling_params.return_routed_experts:
            self._routing.add(seq.seq_id)

    def forget(self, seq_id: int) -> None:
        """A request finished or was withdrawn."""
        self._scoring.discard(seq_id)
        self._routing.discard(seq_id)

    def record_before_apply(self, sampled: SampledTokens) -> list[tuple[Sequence, int, float]]:
        """Record the step's prompt scores and routes (before its tokens are applied: a
        request this step ends still gets them); returns its kept masses with their
        sequences and token counts before the step, for :meth:`record_masses`."""
        if sampled.prompt_scores:
            self._record_prompt_scores(sampled.prompt_scores)
        if sampled.routes:
            self._record_routes(sampled.routes)
        if sampled.kept_mass is None:
            return []
        out = []
        for seq_id, mass in zip(sampled.seq_ids, sampled.kept_mass, strict=True):
            seq = self._unfinished.get(seq_id) if mass is not None else None
            if seq is not None:
                out.append((seq, len(seq.token_ids), mass))
        return out

    @staticmethod
    def record_masses(masses: list[tuple[Sequence, int, float]]) -> None:
        """After the step is applied: a mass is recorded only where its token was kept
        (not past the end, not a non-finite row)."""
        for seq, length, mass in masses:
            if len(seq.token_ids) > length:
                seq.kept_mass.append(mass)

    def _record_prompt_scores(self, scores: dict[int, PromptScores]) -> None:
        """Append each chunk's prompt scores to its request's; a prompt scored again
        (recomputed after a preemption) keeps the scores it already has."""
        for seq_id, (first, logprobs, tops, ranks) in scores.items():
            seq = self._unfinished.get(seq_id)
            if seq is None:
                continue  # withdrawn while the step ran
            skip = len(seq.prompt_logprobs) + 1 - first  # prompt index 1 is entry 0
            if skip < 0:
                raise ValueError(f"sequence {seq_id}: prompt scores from index {first} but "
                                 f"only {len(seq.prompt_logprobs)} recorded before it")
            seq.prompt_logprobs.extend(logprobs[skip:])
            seq.prompt_top_logprobs.extend(tops[skip:])
            seq.prompt_ranks.extend(ranks[skip:])

    def _record_routes(self, routes: dict[int, StepRoutes]) -> None:
        """Append each row's routed experts to its request's; positions it holds
        already (asked again after a step in flight, or recomputed after a preemption)
        keep their first routes."""
        for seq_id, (first, ids) in routes.items():
            seq = self._unfinished.get(seq_id)
            if seq is None:
                continue  # withdrawn while the step ran
            skip = seq.num_routes - first
            if skip < 0:
                raise ValueError(f"sequence {seq_id}: routes from position {first} but only "
                                 f"{seq.num_routes} recorded before it")
            if skip < len(ids):
                seq.routes.append(ids[skip:])
                seq.num_routes += len(ids) - skip
