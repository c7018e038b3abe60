"""Test-only hooks that make a tensor-parallel worker misbehave on purpose.

Read once, from the environment variable :data:`TEST_HOOKS_ENV`, by each worker at
start-up; when it is unset (always, outside tests) the worker makes one ``None``
check and nothing here runs. The value is JSON::

    {"fail": {"rank": 1, "at": "load"}}                   # raise before loading
    {"fail": {"rank": 0, "at": "step", "step": 3}}        # raise in its 3rd step
    {"fail": {"rank": 1, "at": "step", "mode": "exit"}}   # die without reporting
    {"fail": {"rank": 1, "at": "step", "mode": "hang"}}   # stop answering
    {"cpu_cache_bytes": {"1": 2000000}}                   # rank 1's own CPU budget
    {"wake_pressure": {"rank": 1, "bytes": 10**9, "while_file": "/tmp/p"}}

``mode`` is ``"raise"`` (default: the worker reports the exception, as any real
error), ``"exit"`` (``os._exit``: a crash that leaves no report, as a segfault or
the OOM killer would) or ``"hang"`` (sleeps: a rank stuck without a word).
``cpu_cache_bytes`` gives ranks different memory budgets, so tests can check that
the group agrees on the smallest pool. ``wake_pressure`` makes a rank's wake see
``bytes`` fewer available (as if another process held them) while ``while_file``
exists, so a test can take the pressure away and retry.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import attrs

from kvrunner.config import EngineConfig
from kvrunner.engine.step_io import PackedSampled, StepInput

TEST_HOOKS_ENV = "KVRUNNER_TP_TEST_HOOKS"

#: exit code of a worker killed by an ``"exit"`` fault
FAULT_EXIT_CODE = 86
#: how long a ``"hang"`` fault sleeps (longer than any test waits)
HANG_S = 3600.0


class InjectedFault(RuntimeError):
    """The failure a test asked for (never raised unless TEST_HOOKS_ENV is set)."""


@attrs.frozen(kw_only=True)
class FaultPlan:
    """What the test hooks ask of each rank."""

    fail_rank: int | None = None
    fail_at: str | None = attrs.field(
        default=None, validator=attrs.validators.in_((None, "load", "step"))
    )
    fail_step: int = 1
    fail_mode: str = attrs.field(
        default="raise", validator=attrs.validators.in_(("raise", "exit", "hang"))
    )
    cpu_cache_bytes: dict[int, int] = attrs.field(factory=dict)
    pressure_rank: int | None = None
    pressure_bytes: int = 0
    pressure_file: str | None = None

    @classmethod
    def from_env(cls) -> FaultPlan | None:
        raw = os.environ.get(TEST_HOOKS_ENV)
        if not raw:
            return None
        data = json.loads(raw)
        fail = data.get("fail") or {}
        pressure = data.get("wake_pressure") or {}
        return cls(
            pressure_rank=pressure.get("rank"),
            pressure_bytes=int(pressure.get("bytes", 0)),
            pressure_file=pressure.get("while_file"),
            fail_rank=fail.get("rank"),
            fail_at=fail.get("at"),
            fail_step=int(fail.get("step", 1)),
            fail_mode=fail.get("mode", "raise"),
            cpu_cache_bytes={int(r): int(b) for r, b in data.get("cpu_cache_bytes", {}).items()},
        )

    def config_for(self, rank: int, config: EngineConfig) -> EngineConfig:
        """``config`` with this rank's CPU cache budget, if the plan sets one."""
        if rank not in self.cpu_cache_bytes:
            return config
        cache = attrs.evolve(config.cache, cpu_cache_bytes=self.cpu_cache_bytes[rank])
        return attrs.evolve(config, cache=cache)

    def wake_pressure_for(self, rank: int) -> Callable[[], int]:
        """Bytes this rank's wake should treat as taken, asked at each wake."""
        if rank != self.pressure_rank:
            return lambda: 0
        path = self.pressure_file
        return lambda: self.pressure_bytes if path is None or os.path.exists(path) else 0

    def _fail(self, what: str) -> None:
        if self.fail_mode == "exit":
            os._exit(FAULT_EXIT_CODE)
        if self.fail_mode == "hang":
            time.sleep(HANG_S)
        raise InjectedFault(f"injected failure {what} ({TEST_HOOKS_ENV})")

    def before_load(self, rank: int) -> None:
        if self.fail_rank == rank and self.fail_at == "load":
            self._fail("at load")

    def wrap(self, rank: int, runner: Any) -> Any:
        """``runner``, or a stand-in whose ``execute`` fails at the planned step."""
        if self.fail_rank != rank or self.fail_at != "step":
            return runner
        return _FailingRunner(runner, self)


class _FailingRunner:
    """Delegates to the real runner, failing in the planned step (1-based)."""

    def __init__(self, runner: Any, plan: FaultPlan) -> None:
        self._runner = runner
        self._plan = plan
        self._steps = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def execute(self, step: StepInput) -> PackedSampled:
        self._count_step()
        return self._runner.execute(step)

    def launch(self, step: StepInput) -> Any:
        self._count_step()
        return self._runner.launch(step)

    def _count_step(self) -> None:
        self._steps += 1
        if self._steps == self._plan.fail_step:
            self._plan._fail(f"in step {self._steps}")
