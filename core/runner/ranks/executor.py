"""Executors: what the engine calls to run a step, on one rank or a whole TP group.

Every executor implements the engine's ``Executor`` protocol (``num_blocks`` and
``execute(StepInput) -> SampledTokens``) and adds ``model_info`` (what the
driver needs without the weights), ``call_ranks(method, *args)`` (one of
:class:`~kvrunner.runner.ranks.rank_calls.RankCalls`' methods on every rank, answers in
rank order, a refusal raised here) and ``ranks``, the typed
:class:`~kvrunner.runner.ranks.rank_client.RankClient` over it, ``capture()``,
``describe_ranks()`` and ``shutdown()``.

- :class:`LocalExecutor`: one rank, the runner in this process.
- :class:`MultiprocExecutor`: one spawned process per rank; the engine stays here.
- :class:`~kvrunner.runner.ranks.broadcast_executor.BroadcastExecutor`: torchrun; this
  process is rank 0 (engine and runner), other ranks serve the commands it broadcasts.

Each also has ``submit(StepInput)``, which launches a step and returns at once with a
handle whose ``result()`` waits for its tokens: the engine's asynchronous steps
schedule the next step in between.

``num_blocks`` is always the group's agreed minimum: every rank reports the number
it allocated and the executor refuses a group whose ranks disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs
import torch

from kvrunner.config import ConfigError, EngineConfig
from kvrunner.distributed.group import check_all_reduce, connect_store, resolve_backend
from kvrunner.distributed.heartbeat import HeartbeatMonitor
from kvrunner.distributed.supervisor import FAILURE_GRACE_S, Ticket, WorkerProcesses
from kvrunner.engine.step_io import PackedSampled, SampledTokens, StepInput, unpack_sampled
from kvrunner.held_sigint import sigint_held
from kvrunner.runner.model_info import ModelInfo, agreed_batched_tokens, agreed_num_blocks
from kvrunner.runner.model_len import ModelLen, agreed_model_len
from kvrunner.runner.pools.sizing import release_unreachable_memory
from kvrunner.runner.ranks.rank_calls import RankCalls, call_name, raise_refused
from kvrunner.runner.ranks.rank_client import RankClient
from kvrunner.runner.ranks.worker import SpawnSpec, run_spawned_rank
from kvrunner.runner.step.launched_step import SubmittedStep

__all__ = ["DriverExecutor", "LocalExecutor", "ModelInfo", "MultiprocExecutor", "make_executor"]


class DriverExecutor(Protocol):
    """The engine's ``Executor`` plus what :class:`~kvrunner.llm.LLM` uses."""

    num_blocks: int
    #: the step budget every rank resolved (``max_num_batched_tokens`` when unset)
    max_num_batched_tokens: int
    #: the max_model_len every rank resolved, and why (the config's, when set)
    model_len: ModelLen
    model_info: ModelInfo
    #: the in-process runner (rank 0's under torchrun), or None when ranks are spawned
    runner: Any

    def execute(self, step: StepInput) -> SampledTokens: ...

    def submit(self, step: StepInput) -> SubmittedStep: ...

    #: every rank's RankCalls, typed (over call_ranks)
    ranks: RankClient

    def call_ranks(self, method: Callable[..., Any], *args: Any) -> list[Any]: ...

    def capture(self) -> float: ...

    def describe_ranks(self) -> list[dict[str, Any]]: ...

    def check(self) -> None: ...

    def watch(self) -> None: ...

    def settle(self) -> None: ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    """A single rank in this process."""

    def __init__(self, config: EngineConfig, *, progress: bool = False) -> None:
        from kvrunner.runner.model_runner import ModelRunner

        self.runner: Any = ModelRunner(config, progress=progress)
        self.num_blocks = self.runner.pool_size.num_blocks
        self.max_num_batched_tokens = self.runner.max_num_batched_tokens
        self.model_len = self.runner.model_len
        self.model_info = ModelInfo.from_runner(self.runner)
        self._rank: RankCalls | None = RankCalls(self.runner, 0)
        self.ranks = RankClient(self.call_ranks)

    def execute(self, step: StepInput) -> SampledTokens:
        self.check()
        return unpack_sampled(self.runner.execute(step))

    def submit(self, step: StepInput) -> SubmittedStep:
        """Launch the step; its tokens are read when the handle's ``result()`` asks."""
        self.check()
        return SubmittedStep(self.runner.launch(step).result)

    def call_ranks(self, method: Callable[..., Any], *args: Any) -> list[Any]:
        self.check()
        call_name(method)  # the same calls as the other executors
        return [method(self._rank, *args)]

    def capture(self) -> float:
        return self.ranks.capture()[0]

    def describe_ranks(self) -> list[dict[str, Any]]:
        return self.ranks.describe()

    def check(self) -> None:
        """Raise if this executor was shut down."""
        if self.runner is None:
            raise RuntimeError("this LLM was shut down; its model and cache are released")

    def watch(self) -> None:
        """Between steps: the rank is this process, which nothing can lose while it
        runs; raise only if shut down."""
        self.check()

    def settle(self) -> None:
        """Wait until the device has finished every step launched (after an
        interrupted call: the blocks they write go back to the pool)."""
        self.check()
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

    def shutdown(self) -> None:
        """Release the runner: weights, pools and graphs go, and so does their memory
        once nothing else holds them, and the rank leaves its weight-update group
        (idempotent)."""
        if self.runner is None:
            return
        device = self.runner.device
        if self._rank is not None:  # its group's name is this process's to reuse
            self._rank.destroy_weights_update_group()
        self.runner = self._rank = None
        release_unreachable_memory(device)  # graphs and modules hold reference cycles


class MultiprocExecutor:
    """Tensor parallelism over spawned rank processes; the engine stays in the driver.

    Steps go to every rank over its pipe; rank 0, the one rank that samples,
    answers with the tokens (as columns: see :mod:`kvrunner.engine.step_io`). Any rank's
    failure, death, silence past ``distributed_timeout_s`` or heartbeat stopped
    for ``heartbeat_timeout_s`` raises one
    :class:`~kvrunner.distributed.errors.WorkerError` naming the rank, and stops
    the group. An interrupted call (Ctrl-C) leaves it serving: :meth:`settle`.
    Create it under ``if __name__ == "__main__":`` (spawn re-imports
    the main module).
    """

    runner = None  # the runners live in the rank processes

    def __init__(self, config: EngineConfig, *, progress: bool = False) -> None:
        # Fail early, before spawning: the checkpoint, and collectives this host can run.
        self.model_info = ModelInfo.from_checkpoint(config)
        check_collectives(config)
        # Ranks load the resolved directory: a default model is written once, here.
        config = attrs.evolve(config, model=str(self.model_info.path))
        parallel = config.parallel
        # A little past the collectives' own timeout: a rank left waiting by a hung
        # peer then reports its timed-out collective first, and the driver can name
        # the silent peer as the cause rather than the rank it was waiting on.
        self.timeout_s = parallel.distributed_timeout_s + FAILURE_GRACE_S + 3.0
        # The driver serves the store the ranks meet through: port 0 lets the OS pick
        # a free one, so concurrent groups on one host never collide.
        self._store = connect_store("127.0.0.1", 0, timeout_s=self.timeout_s, is_master=True)
        spec = SpawnSpec(config=config, store_host="127.0.0.1", store_port=self._store.port,
                         progress=progress)
        self.procs = WorkerProcesses(
            run_spawned_rank, world_size=parallel.tensor_parallel_size, args=(spec,),
            heartbeats=HeartbeatMonitor(self._store, world_size=parallel.tensor_parallel_size,
                                        timeout_s=parallel.heartbeat_timeout_s),
        )
        ready = self.procs.collect(
            self.procs.startup_ticket, during="start-up (load, sizing, capture)",
            timeout_s=parallel.startup_timeout_s,
        )
        described = [ready[r] for r in sorted(ready)]
        self.num_blocks = agreed_num_blocks(described)
        self.max_num_batched_tokens = agreed_batched_tokens(described)
        self.model_len = agreed_model_len(described)
        self.ranks = RankClient(self.call_ranks)
        # Rank 0 defers each answer until the next step arrives (see worker.py).
        self._deferred = config.scheduler.async_scheduling
        self._steps_sent = 0
        # the last step whose answer was asked for with ("answer",) (deferred answers)
        self._asked_for = -1

    def execute(self, step: StepInput) -> SampledTokens:
        return self.submit(step).result()

    def submit(self, step: StepInput) -> SubmittedStep:
        """Send the step to every rank; ``result()`` waits for rank 0's answer. Rank 0
        answers its steps in order, so results must be asked for in order too."""
        # A Ctrl-C during the send is held until the step is counted as sent too: a
        # step the ranks have but the count lacks is one whose held answer (deferred
        # answers) settle() would never ask for, and would wait for forever.
        with sigint_held():
            ticket = self.procs.send_all(("step", step), during="a step", replies_from=(0,))
            index = self._steps_sent
            self._steps_sent += 1
        return SubmittedStep(lambda: self._answer(index, ticket))

    def _answer(self, index: int, ticket: Ticket) -> PackedSampled:
        self._ask_for_last(index)
        return self.procs.collect(ticket, during="a step", timeout_s=self.timeout_s)[0]

    def _ask_for_last(self, index: int) -> None:
        """Rank 0 answers a step once it has the next (or a call); for the last step
        sent there is none: ask for it, once."""
        if self._deferred and index == self._steps_sent - 1 and self._asked_for < index:
            with sigint_held():  # asked for and noted as asked together
                self.procs.send_all(("answer",), during="a step")
                self._asked_for = index

    def call(self, name: str, *args: Any) -> list[Any]:
        """Run worker method ``name`` on every rank; the answers in rank order."""
        during = f"call {name!r}"
        ranks = range(self.procs.world_size)
        ticket = self.procs.send_all(("call", name, args), during=during, replies_from=ranks)
        replies = self.procs.collect(ticket, during=during, timeout_s=self.timeout_s)
        return [replies[r] for r in ranks]

    def settle(self) -> None:
        """After an interrupted call: wait until every rank has finished every command
        sent, dropping the answers nobody reads, so the group is back in step."""
        self._ask_for_last(self._steps_sent - 1)
        self.procs.settle(during="settling an interrupted call", timeout_s=self.timeout_s)

    def call_ranks(self, method: Callable[..., Any], *args: Any) -> list[Any]:
        return raise_refused(self.call(call_name(method), *args))

    def check(self) -> None:
        """Raise the group's earlier failure (WorkerError) if it had one, or if shut down."""
        self.procs.check_usable()

    def watch(self) -> None:
        """Between steps: raise WorkerError naming a rank that died, failed or stopped
        beating since it was last heard (the group is then stopped); at once
        otherwise (a poll of the ranks' pipes and process sentinels)."""
        self.procs.watch(during="idle (between steps)")

    def capture(self) -> float:
        return max(self.ranks.capture())

    def describe_ranks(self) -> list[dict[str, Any]]:
        return self.ranks.describe()

    def shutdown(self) -> None:
        self.procs.shutdown()


def check_collectives(config: EngineConfig) -> None:
    """Raise ConfigError if the ranks could not run the configured collectives here."""
    from kvrunner.runner.setup import resolve_device

    parallel = config.parallel
    backend = resolve_backend(parallel.distributed_backend, resolve_device(config.device))
    check_all_reduce(parallel.all_reduce, backend)


def make_executor(config: EngineConfig, *, progress: bool = False) -> Any:
    """The executor ``config.parallel`` asks for (torchrun's is built by ``launch``)."""
    parallel = config.parallel
    if parallel.tensor_parallel_size == 1:
        return LocalExecutor(config, progress=progress)
    if parallel.distributed_executor == "torchrun":
        raise ConfigError(
            "distributed_executor='torchrun': start every rank with torchrun and call "
            "kvrunner.launch.launch(...) on each (rank 0 gets the LLM)"
        )
    from kvrunner.runner.ranks.main_guard import check_main_guard

    check_main_guard(f"tensor_parallel_size={parallel.tensor_parallel_size}")
    return MultiprocExecutor(config, progress=progress)
