"""Each conformance check fails on a backend mutated to break exactly what it guards.

The same checks pass on the unmutated ``paged`` backend (``test_backends.py``), so
each failure here is the mutation's, and the check is not vacuous.
"""

from __future__ import annotations

import pytest
from mutants import AUDIT_MUTANTS, MUTANTS, NoReleaseCache

from kvrunner.plugin_api import BackendError
from kvrunner.plugin_host.plugins import discover_backends, register_backend, unregister_backend
from kvrunner.testing.conformance import (
    CHECKS,
    GPU_PATH_ONLY,
    ConformanceError,
    Target,
    run_check,
)
from kvrunner_paged import PagedBackend


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


@pytest.mark.parametrize("name", sorted(AUDIT_MUTANTS))
def test_the_kit_catches_each_defect_the_runtime_audit_must_catch(name: str) -> None:
    factory, check = AUDIT_MUTANTS[name]
    register_backend(name, factory)
    try:
        (target,) = Target.of(name)
        with pytest.raises((ConformanceError, ExceptionGroup)) as raised:
            run_check(target, check, max_examples=8)
    finally:
        unregister_backend(name)
    # hypothesis reports distinct failing examples together: each must be the check's
    group = raised.value
    failures = group.exceptions if isinstance(group, ExceptionGroup) else (group,)
    assert all(isinstance(e, ConformanceError) for e in failures), failures


def test_a_backend_that_allocates_without_release_cache_is_refused_at_load() -> None:
    with pytest.raises(BackendError, match="'mutant-no-release'.*release_cache"):
        register_backend("mutant-no-release", NoReleaseCache)
    assert "mutant-no-release" not in discover_backends()


class NoCaptureMetadata(NoReleaseCache):
    """Builds real steps' metadata and has no ``build_capture_metadata``: every eager
    step works, and the first capture would find no metadata."""

    build_capture_metadata = None
    release_cache = PagedBackend.release_cache


class AllocatesWithoutSpec(NoReleaseCache):
    """Allocates pools and states no ``cache_spec``: the sizing counts none of them."""

    cache_spec = None
    release_cache = PagedBackend.release_cache


@pytest.mark.parametrize("factory, hook", [(NoCaptureMetadata, "build_capture_metadata"),
                                           (AllocatesWithoutSpec, "cache_spec")])
def test_a_backend_without_a_required_hook_is_refused_at_load_naming_it(factory, hook) -> None:
    with pytest.raises(BackendError, match=f"'mutant-missing' implements \\w+ but not {hook}"):
        register_backend("mutant-missing", factory)
    assert "mutant-missing" not in discover_backends()
