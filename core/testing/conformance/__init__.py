"""The conformance kit: properties every kvrunner backend must have, runnable anywhere.

Use it from a backend's own tests (see docs/plugins.md, "The conformance kit")::

    from kvrunner.testing.conformance import conformance_suite

    test_conformance = conformance_suite("mybackend")

or from the command line: ``kvrunner check-backend mybackend``. A backend gives the
kit one thing beyond its hooks: a ``cache_rows(pool_name, pool)`` attribute on its
factory (required of every layer backend), saying which row of a pool holds a KV
slot or a request slot.

Pieces: :mod:`.cases` (hypothesis strategies for valid steps), :mod:`.reference`
(naive full attention and gated delta rule), :mod:`.rig` (a backend set up as a
runner sets it up), :mod:`.checks` (the properties), :mod:`.probes` and
:mod:`.batch_invariance` (the ``batch_invariant`` promise, through a whole engine).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hypothesis import HealthCheck, Phase, given, settings

from kvrunner.testing.conformance.cases import StepCase, step_cases
from kvrunner.testing.conformance.checks import (
    BATCH_INVARIANCE_PROMISE,
    CHECKS,
    DECODE_ONLY,
    ENGINE_CHECKS,
    GPU_PATH_ONLY,
    OVERLAP_PROMISE,
    ConformanceError,
)
from kvrunner.testing.conformance.probes import ProbeCase, probe_cases
from kvrunner.testing.conformance.rig import Rig, Target

__all__ = [
    "BATCH_INVARIANCE_PROMISE",
    "CHECKS",
    "ENGINE_CHECKS",
    "GPU_PATH_ONLY",
    "OVERLAP_PROMISE",
    "ConformanceError",
    "ProbeCase",
    "Rig",
    "StepCase",
    "Target",
    "conformance_suite",
    "not_run_because",
    "probe_cases",
    "run_check",
    "step_cases",
]


def not_run_because(target: Target, check: str) -> str | None:
    """Why ``check`` does not apply to ``target``, or None when it does: a check of
    :data:`GPU_PATH_ONLY` needs ``use_triton``, one of :data:`OVERLAP_PROMISE` a backend
    declaring ``supports_overlap``, one of :data:`BATCH_INVARIANCE_PROMISE` a backend
    declaring ``batch_invariant`` (a backend that does not is not held to it)."""
    if check in GPU_PATH_ONLY and not target.use_triton:
        return (f"{check} checks the path a CUDA step takes: run it on "
                f"Target.of({target.name!r}, use_triton=True)")
    if check in OVERLAP_PROMISE and not target.supports_overlap:
        return f"{check} checks the supports_overlap promise, which {target.name!r} does not make"
    if check in BATCH_INVARIANCE_PROMISE and not target.batch_invariant:
        return (f"{check} checks the batch_invariant promise, which {target.name!r} does not "
                f"make (batch_invariant is False: the engine refuses deterministic=True over it)")
    return None


def run_check(target: Target, check: str, *, max_examples: int = 8) -> int:
    """Run one check over up to ``max_examples`` hypothesis cases; raises on the first
    failure (shrunk to a minimal case). Returns the number of cases that ran and
    passed (at least one: a check that ran none proves nothing, and raises).
    ``ValueError`` when the check does not apply to the target (:func:`not_run_because`
    says why)."""
    fn = CHECKS[check]
    reason = not_run_because(target, check)
    if reason is not None:
        raise ValueError(reason)
    # An engine check builds engines per case: its first failing case is reported as
    # found, since shrinking it would rebuild them hundreds of times.
    phases = [p for p in Phase if p != Phase.shrink or check not in ENGINE_CHECKS]
    checked = settings(
        max_examples=max_examples, deadline=None, database=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], phases=phases,
    )  # fmt: skip
    passed = 0
    if check in ENGINE_CHECKS:

        @checked
        @given(case=probe_cases())
        def run_engine(case: ProbeCase) -> None:
            nonlocal passed
            fn(target, case)
            passed += 1

        run_engine()
    else:

        @checked
        @given(case=step_cases(decode=True if check in DECODE_ONLY else None))
        def run(case: StepCase) -> None:
            nonlocal passed
            fn(Rig(target, seed=case.seed), case)
            passed += 1

        run()
    if passed == 0:
        raise RuntimeError(f"the check {check!r} ran no case on {target.name!r}")
    return passed


def conformance_suite(
    backend: str, *, use_triton: bool = False, device: str = "cpu", max_examples: int = 8,
    checks: Sequence[str] | None = None,
) -> Callable[..., None]:
    """A pytest test function, parametrized by layer type and check, for ``backend``
    (the checks that apply to it: :func:`not_run_because`)."""
    import pytest

    targets = Target.of(backend, use_triton=use_triton, device=device)
    names = [c for c in checks or CHECKS if not_run_because(targets[0], c) is None]
    layer_types = [t.layer_type for t in targets]

    @pytest.mark.parametrize("check", names)
    @pytest.mark.parametrize("layer_type", layer_types)
    def test_conformance(layer_type: str, check: str) -> None:
        (target,) = [
            t for t in Target.of(backend, use_triton=use_triton, device=device)
            if t.layer_type == layer_type
        ]
        run_check(target, check, max_examples=max_examples)

    return test_conformance
