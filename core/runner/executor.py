"""Executors: what the engine calls to run a step, on one rank or a whole TP group.

Every executor implements the engine's ``Executor`` protocol (``num_blocks`` and
``execute(StepInput) -> list[SampledToken]``) and adds ``model_info`` (what the
driver needs without the weights), ``call_ranks(name, *args)`` (one of
:class:`~kvrunner.runner.rank_calls.RankCalls` on every rank, answers in rank order,
a refusal raised here), ``capture()``, ``describe_ranks()`` and ``shutdown()``.

- :class:`LocalExecutor`: one rank, the runner in this process.
- :class:`MultiprocExecutor`: one spawned process per rank; the engine stays here.
- :class:`BroadcastExecutor`: torchrun; this process is rank 0 (engine and runner),
  other ranks serve the commands it broadcasts (:func:`serve_broadcast`).

``num_blocks`` is always the group's agreed minimum: every rank reports the number
it allocated and the executor refuses a group whose ranks disagree.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import traceback
import weakref
from pathlib import Path
from typing import Any, Protocol

import attrs
import torch
from tokenizers import Tokenizer

from kvrunner.batch import SampledToken, StepInput, unpack_sampled
from kvrunner.config import ConfigError, EngineConfig
from kvrunner.distributed.control import BroadcastChannel
from kvrunner.distributed.errors import CollectiveError, RankFailure, WorkerError, worker_error
from kvrunner.distributed.group import check_all_reduce, connect_store, resolve_backend
from kvrunner.distributed.supervisor import FAILURE_GRACE_S, WorkerProcesses
from kvrunner.runner.rank_calls import RankCalls, raise_refused
from kvrunner.runner.worker import RankWorker, SpawnSpec, run_spawned_rank


@attrs.frozen(kw_only=True)
class ModelInfo:
    """What the driver knows about the model: enough for the engine and the API."""

    path: Path
    #: None when the checkpoint has no tokenizer (or skip_tokenizer_init): token ids only
    tokenizer: Tokenizer | None
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    layer_types: tuple[str, ...]

    @property
    def uses_state_slots(self) -> bool:
        return "linear_attention" in self.layer_types

    @classmethod
    def from_runner(cls, runner: Any) -> ModelInfo:
        return cls(
            path=runner.model_path,
            tokenizer=runner.tokenizer,
            eos_token_ids=tuple(runner.model_config.eos_token_id),
            vocab_size=runner.model_config.vocab_size,
            layer_types=tuple(runner.spec.layer_types),
        )

    @classmethod
    def from_checkpoint(cls, config: EngineConfig) -> ModelInfo:
        """Read config and tokenizer only; also checks the model splits over the group."""
        from kvrunner.models.checkpoint_files import load_tokenizer
        from kvrunner.models.loader import (
            check_model_len,
            load_hf_config,
            model_spec,
            parse_config,
        )
        from kvrunner.runner.setup import resolve_model_path

        path = resolve_model_path(config.model)
        raw = load_hf_config(path)
        spec = model_spec(raw, tp_size=config.parallel.tensor_parallel_size)  # raises if not
        check_model_len(config.scheduler.max_model_len, raw)
        parsed = parse_config(raw)[1]
        return cls(
            path=path,
            tokenizer=load_tokenizer(path, skip=config.skip_tokenizer_init),
            eos_token_ids=tuple(parsed.eos_token_id),
            vocab_size=parsed.vocab_size,
            layer_types=tuple(spec.layer_types),
        )


class DriverExecutor(Protocol):
    """The engine's ``Executor`` plus what :class:`~kvrunner.llm.LLM` uses."""

    num_blocks: int
    model_info: ModelInfo
    #: the in-process runner (rank 0's under torchrun), or None when ranks are spawned
    runner: Any

    def execute(self, step: StepInput) -> list[SampledToken]: ...

    def call_ranks(self, name: str, *args: Any) -> list[Any]: ...

    def capture(self) -> float: ...

    def describe_ranks(self) -> list[dict[str, Any]]: ...

    def check(self) -> None: ...

    def shutdown(self) -> None: ...


def _agreed(descriptions: list[dict[str, Any]]) -> int:
    counts = [d["num_blocks"] for d in descriptions]
    if len(set(counts)) != 1:
        raise RuntimeError(f"ranks allocated different pool sizes {counts}; they must agree")
    return counts[0]


class LocalExecutor:
    """A single rank in this process."""

    def __init__(self, config: EngineConfig, *, progress: bool = False) -> None:
        from kvrunner.runner.model_runner import ModelRunner

        self.runner: Any = ModelRunner(config, progress=progress)
        self.num_blocks = self.runner.num_blocks
        self.model_info = ModelInfo.from_runner(self.runner)
        self._rank = _LocalRank(self.runner)

    def execute(self, step: StepInput) -> list[SampledToken]:
        self.check()
        return unpack_sampled(self.runner.execute(step))

    def call_ranks(self, name: str, *args: Any) -> list[Any]:
        self.check()
        return [getattr(self._rank, name)(*args)]

    def capture(self) -> float:
        return self.call_ranks("capture")[0]

    def describe_ranks(self) -> list[dict[str, Any]]:
        return self.call_ranks("describe")

    def check(self) -> None:
        """Raise if this executor was shut down."""
        if self.runner is None:
            raise RuntimeError("this LLM was shut down; its model and cache are released")

    def shutdown(self) -> None:
        """Release the runner: weights, pools and graphs go, and so does their memory
        once nothing else holds them (idempotent)."""
        if self.runner is None:
            return
        device = self.runner.device
        self.runner = self._rank = None
        gc.collect()  # graphs and modules hold reference cycles
        if device.type == "cuda":
            torch.cuda.empty_cache()


class _LocalRank(RankCalls):
    def __init__(self, runner: Any) -> None:
        self.runner, self.rank = runner, 0


class MultiprocExecutor:
    """Tensor parallelism over spawned rank processes; the engine stays in the driver.

    Steps go to every rank over its pipe; rank 0, the one rank that samples,
    answers with the tokens (as columns: see :mod:`kvrunner.batch`). Any rank's
    failure, death or silence past ``distributed_timeout_s`` raises one
    :class:`~kvrunner.distributed.errors.WorkerError` naming the rank, and stops
    the group. Create it under ``if __name__ == "__main__":`` (spawn re-imports
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
            run_spawned_rank, world_size=parallel.tensor_parallel_size, args=(spec,)
        )
        ready = self.procs.collect(
            range(self.procs.world_size), during="start-up (load, sizing, capture)",
            timeout_s=parallel.startup_timeout_s,
        )
        self.num_blocks = _agreed([ready[r] for r in sorted(ready)])

    def execute(self, step: StepInput) -> list[SampledToken]:
        self.procs.send_all(("step", step), during="a step")
        packed = self.procs.collect([0], during="a step", timeout_s=self.timeout_s)[0]
        return unpack_sampled(packed)

    def call(self, name: str, *args: Any) -> list[Any]:
        """Run worker method ``name`` on every rank; the answers in rank order."""
        during = f"call {name!r}"
        self.procs.send_all(("call", name, args), during=during)
        replies = self.procs.collect(range(self.procs.world_size), during=during,
                                     timeout_s=self.timeout_s)
        return [replies[r] for r in range(self.procs.world_size)]

    def call_ranks(self, name: str, *args: Any) -> list[Any]:
        return raise_refused(self.call(name, *args))

    def check(self) -> None:
        """Raise the group's earlier failure (WorkerError) if it had one, or if shut down."""
        self.procs.check_usable()

    def capture(self) -> float:
        return max(self.call_ranks("capture"))

    def describe_ranks(self) -> list[dict[str, Any]]:
        return self.call_ranks("describe")

    def shutdown(self) -> None:
        self.procs.shutdown()


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
        self.num_blocks = _agreed(self._all("describe"))

    def _peer_error(self, during: str, own: BaseException) -> BaseException:
        """The error to raise for a failed collective; the group is unusable after it."""
        peers = self.channel.peer_failures(FAILURE_GRACE_S)
        self.failure = worker_error([*peers, RankFailure.from_exception(0, own)], during=during)
        self._stopper.detach()  # the peers are gone: no "stop" to send
        return self.failure if peers else own

    def execute(self, step: StepInput) -> list[SampledToken]:
        self.check()
        try:
            self.channel.send(("step", step))
            return unpack_sampled(self.worker.step(step))
        except CollectiveError as e:
            raise self._peer_error("a step", e) from e

    def _all(self, name: str, *args: Any) -> list[Any]:
        self.check()
        try:
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

    def call_ranks(self, name: str, *args: Any) -> list[Any]:
        return raise_refused(self._all(name, *args))

    def capture(self) -> float:
        return max(self.call_ranks("capture"))

    def describe_ranks(self) -> list[dict[str, Any]]:
        return self.call_ranks("describe")

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
    raise as a WorkerError naming this rank, and then False is returned, so this
    process exits cleanly and torchrun leaves rank 0 the time to do that (see
    :mod:`~kvrunner.distributed.control`); one that cannot be reported is raised.
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
            "kvrunner.distributed.launch.launch(...) on each (rank 0 gets the LLM)"
        )
    from kvrunner.main_guard import check_main_guard

    check_main_guard(f"tensor_parallel_size={parallel.tensor_parallel_size}")
    return MultiprocExecutor(config, progress=progress)
