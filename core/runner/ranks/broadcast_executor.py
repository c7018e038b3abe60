"""torchrun's executor: rank 0 runs the engine and its own rank, and broadcasts each
command to the other ranks, which serve them (:func:`serve_broadcast`)."""

from __future__ import annotations

import contextlib
import sys
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import torch

from kvrunner.distributed.control import BroadcastChannel
from kvrunner.distributed.errors import CollectiveError, RankFailure, WorkerError, worker_error
from kvrunner.distributed.supervisor import FAILURE_GRACE_S
from kvrunner.engine.step_io import PackedSampled, SampledTokens, StepInput
from kvrunner.held_sigint import sigint_held
from kvrunner.runner.model_info import ModelInfo, agreed_batched_tokens, agreed_num_blocks
from kvrunner.runner.model_len import agreed_model_len
from kvrunner.runner.ranks.rank_calls import RankCalls, call_name, raise_refused
from kvrunner.runner.ranks.rank_client import RankClient
from kvrunner.runner.ranks.worker import RankWorker
from kvrunner.runner.step.launched_step import LaunchedStep, SubmittedStep


class BroadcastExecutor:
    """torchrun's rank 0: runs the engine's steps locally and broadcasts them."""

    def __init__(self, worker: RankWorker, channel: BroadcastChannel) -> None:
        self.worker = worker
        self.channel = channel
        self.runner = worker.runner
        self.model_info = ModelInfo.from_runner(worker.runner)
        # Armed first: whatever happens from here, the peers are released in the end.
        self._stopper = weakref.finalize(self, _stop_broadcast, channel)
        self.failure: WorkerError | None = None
        self.ranks = RankClient(self.call_ranks)
        described = self._all(call_name(RankCalls.describe))
        self.num_blocks = agreed_num_blocks(described)
        self.max_num_batched_tokens = agreed_batched_tokens(described)
        self.model_len = agreed_model_len(described)

    def _peer_error(self, during: str, own: BaseException) -> BaseException:
        """The error to raise for a failed collective; the group is unusable after it."""
        peers = self.channel.peer_failures(FAILURE_GRACE_S)
        self.failure = worker_error([*peers, RankFailure.from_exception(0, own)], during=during)
        self._stopper.detach()  # the peers are gone: no "stop" to send
        return self.failure if peers else own

    def execute(self, step: StepInput) -> SampledTokens:
        return self.submit(step).result()

    def submit(self, step: StepInput) -> SubmittedStep:
        """Broadcast the step and launch rank 0's share; ``result()`` reads its tokens."""
        self.check()
        try:
            # Rank 0 launches what it broadcast, or the peers wait in the step's
            # collectives for a rank 0 that never joins: a Ctrl-C waits for both.
            with sigint_held():
                self.channel.send(("step", step))
                launched = self.worker.launch(step)
        except CollectiveError as e:
            raise self._peer_error("a step", e) from e
        return SubmittedStep(lambda: self._read(launched))

    def _read(self, launched: LaunchedStep) -> PackedSampled:
        try:
            return self.worker.finish(launched)
        except CollectiveError as e:
            raise self._peer_error("a step", e) from e

    def _all(self, name: str, *args: Any) -> list[Any]:
        self.check()
        try:
            with sigint_held():  # sent, run and gathered on every rank, or not at all
                self.channel.send(("call", name, args))
                answers = self.channel.gather(self.worker.handle(("call", name, args)))
        except CollectiveError as e:
            raise self._peer_error(f"a call of {name}", e) from e
        assert answers is not None
        return answers

    def check(self) -> None:
        """Raise if shut down (the peers have left); a failed peer surfaces in the
        next collective instead."""
        if self.failure is not None:
            raise WorkerError(
                f"the tensor-parallel group has already failed:\n{self.failure}",
                rank=self.failure.rank, failures=self.failure.failures,
            )
        if not self._stopper.alive:
            raise RuntimeError("this LLM was shut down; the other ranks have left")

    def watch(self) -> None:
        """Between steps: raise the group's failure if it had one. The peers are
        torchrun's processes, not this one's: one that dies while the group is idle is
        found by the next collective (and torchrun stops every rank)."""
        self.check()

    def call_ranks(self, method: Callable[..., Any], *args: Any) -> list[Any]:
        return raise_refused(self._all(call_name(method), *args))

    def settle(self) -> None:
        """After an interrupted call: the peers ran every step broadcast to them in
        lockstep (nothing is owed back); rank 0's device finishes its own."""
        self.check()
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

    def capture(self) -> float:
        return max(self.ranks.capture())

    def describe_ranks(self) -> list[dict[str, Any]]:
        return self.ranks.describe()

    def shutdown(self) -> None:
        """Release ranks > 0 from their serve loop, then leave the group (idempotent).

        Garbage collection and interpreter exit only release the peers: leaving the
        group is left to process exit there.
        """
        if self._stopper.alive:
            self._stopper()
            self.worker.group.destroy()
        elif self.failure is not None:
            with contextlib.suppress(Exception):  # the peers have left already
                self.worker.group.destroy()


def _stop_broadcast(channel: BroadcastChannel) -> None:
    with contextlib.suppress(Exception):  # peers already gone: nothing left to release
        channel.send(("stop",))


def serve_broadcast(worker: RankWorker, channel: BroadcastChannel) -> bool:
    """Ranks > 0 under torchrun: run rank 0's commands until it says stop.

    Returns True on rank 0's stop. An error is printed here, reported for rank 0 to
    raise as a WorkerError naming this rank, and then False is returned: ``launch``
    ends the process with status 0, so torchrun leaves rank 0 the time to do that
    (see :mod:`~kvrunner.distributed.control`); one that cannot be reported is raised.
    """
    try:
        while True:
            command = channel.receive()
            if command[0] == "stop":
                return True
            answer = worker.handle(command)
            if command[0] == "call":
                channel.gather(answer)
    except Exception as e:
        return handed_to_rank_0(channel, worker.rank, e)
    except BaseException as e:  # interrupted: torchrun's teardown is the right answer
        channel.report_failure(RankFailure.from_exception(worker.rank, e))
        raise


def handed_to_rank_0(channel: BroadcastChannel, rank: int, error: Exception) -> bool:
    """Report ``error`` for rank 0 and print it here; re-raise it if unreportable."""
    if not channel.report_failure(RankFailure.from_exception(rank, error)):
        raise error
    print(f"[rank {rank}] failed; rank 0 raises this as a WorkerError:", file=sys.stderr)
    traceback.print_exception(error, file=sys.stderr)
    sys.stderr.flush()
    return False
