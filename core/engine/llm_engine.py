"""The engine loop: schedule, let the runner compute, feed tokens back.

The engine decides who runs; it hands the runner plain ``StepInput`` data and gets
plain ``SampledToken`` data back, so the runner can live in another process.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Protocol

from kvrunner.batch import SampledToken, StepInput
from kvrunner.config import EngineConfig
from kvrunner.engine.block_manager import BlockManager
from kvrunner.engine.scheduler import Scheduler
from kvrunner.engine.sequence import Sequence
from kvrunner.errors import RequestError
from kvrunner.sampling_params import SamplingParams


class Executor(Protocol):
    """What the engine needs from the runner side (one runner or a TP group)."""

    num_blocks: int

    def execute(self, step: StepInput) -> list[SampledToken]: ...


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        *,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        uses_state_slots: bool,
    ) -> None:
        self.config = config
        self.executor = executor
        self.vocab_size = vocab_size
        # The block manager is built on the count the runner derived and agreed on:
        # the engine never sizes anything itself.
        self.block_manager = BlockManager(
            num_blocks=executor.num_blocks,
            block_size=config.cache.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            num_state_slots=config.scheduler.max_num_seqs if uses_state_slots else 0,
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager, eos_token_id=eos_token_ids)
        self._ids = itertools.count()
        self.peak_blocks_used = 0  # most KV blocks in use after any step, since reset

    def validate_prompt(self, token_ids: Seq[int], index: int) -> None:
        """Raise ``RequestError`` naming the request if it can never be served."""
        if not token_ids:
            raise RequestError(f"request {index}: the prompt is empty")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(
                f"request {index}: token id(s) {bad[:5]} outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        limit = self.config.scheduler.max_model_len - 1
        if len(token_ids) > limit:
            raise RequestError(
                f"request {index}: prompt of {len(token_ids)} tokens exceeds "
                f"max_model_len - 1 = {limit}"
            )

    def make_request(self, token_ids: Seq[int], params: SamplingParams, index: int) -> Sequence:
        """A validated, not yet queued request; raises ``RequestError`` naming ``index``."""
        self.validate_prompt(token_ids, index)
        seq = Sequence(next(self._ids), list(token_ids), params)
        self.scheduler.validate(seq, name=f"request {index}")
        return seq

    def add_request(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def step(self) -> list[Sequence]:
        """Run one scheduled step; returns the sequences that finished in it."""
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return []
        step, seqs = scheduled
        sampled = self.executor.execute(step)
        used = self.block_manager.num_blocks - self.block_manager.num_free_blocks
        self.peak_blocks_used = max(self.peak_blocks_used, used)
        return self.scheduler.update(seqs, sampled)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()
