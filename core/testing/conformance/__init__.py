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
runner sets it up), :mod:`.checks` (the properties).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hypothesis import HealthCheck, given, settings

from kvrunner.testing.conformance.cases import StepCase, step_cases
from kvrunner.testing.conformance.checks import (
    CHECKS,
    DECODE_ONLY,
    GPU_PATH_ONLY,
    OVERLAP_PROMISE,
    ConformanceError,
)
from kvrunner.testing.conformance.rig import Rig, Target

__all__ = [
    "CHECKS",
    "GPU_PATH_ONLY",
    "OVERLAP_PROMISE",
    "ConformanceError",
    "Rig",
    "StepCase",
    "Target",
    "conformance_suite",
    "run_check",
    "step_cases",
]


def run_check(target: Target, check: str, *, max_examples: int = 8) -> None:
    """Run one check over ``max_examples`` hypothesis cases; raises on the first failure
    (shrunk to a minimal case). A check of :data:`GPU_PATH_ONLY` needs a target with
    ``use_triton``, one of :data:`OVERLAP_PROMISE` a backend that declares
    ``supports_overlap`` (``ValueError`` otherwise)."""
    fn = CHECKS[check]
    if check in GPU_PATH_ONLY and not target.use_triton:
        raise ValueError(f"{check} checks the path a CUDA step takes: run it on "
                         f"Target.of({target.name!r}, use_triton=True)")
    if check in OVERLAP_PROMISE and not target.supports_overlap:
        raise ValueError(f"{check} checks the supports_overlap promise, which "
                         f"{target.name!r} does not make")

    @settings(
        max_examples=max_examples, deadline=None, database=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )  # fmt: skip
    @given(case=step_cases(decode=True if check in DECODE_ONLY else None))
    def run(case: StepCase) -> None:
        fn(Rig(target, seed=case.seed), case)

    run()


def conformance_suite(
    backend: str, *, use_triton: bool = False, device: str = "cpu", max_examples: int = 8,
    checks: Sequence[str] | None = None,
) -> Callable[..., None]:
    """A pytest test function, parametrized by layer type and check, for ``backend``
    (the checks of :data:`GPU_PATH_ONLY` only with ``use_triton``, those of
    :data:`OVERLAP_PROMISE` only if the backend declares ``supports_overlap``)."""
    import pytest

    targets = Target.of(backend, use_triton=use_triton, device=device)
    names = [c for c in checks or CHECKS
             if (use_triton or c not in GPU_PATH_ONLY)
             and (targets[0].supports_overlap or c not in OVERLAP_PROMISE)]
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
