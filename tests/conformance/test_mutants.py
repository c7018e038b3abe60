"""Each conformance check fails on a backend mutated to break exactly what it guards.

The same checks pass on the unmutated ``paged`` backend (``test_backends.py``), so
each failure here is the mutation's, and the check is not vacuous.
"""

from __future__ import annotations

import pytest
from mutants import MUTANTS

from kvrunner.plugins import register_backend, unregister_backend
from kvrunner.testing.conformance import (
    CHECKS,
    GPU_PATH_ONLY,
    ConformanceError,
    Target,
    run_check,
)


def test_every_check_has_a_mutant() -> None:
    assert set(MUTANTS) == set(CHECKS)


@pytest.mark.parametrize("check", sorted(MUTANTS))
def test_the_check_fails_on_its_mutant(check: str) -> None:
    name, factory = MUTANTS[check]
    register_backend(name, factory)
    try:
        # a check of the CUDA path runs on the Triton kernels (interpreted on the CPU)
        (target,) = Target.of(name, use_triton=check in GPU_PATH_ONLY)
        with pytest.raises(ConformanceError):
            run_check(target, check, max_examples=25)
    finally:
        unregister_backend(name)


def test_the_audit_check_fails_on_a_backend_that_declares_nothing(flatkv_installed) -> None:
    (target,) = Target.of("leaky")
    with pytest.raises(ConformanceError, match="audit"):
        run_check(target, "serve_sleep_wake_recapture_under_audit", max_examples=3)
