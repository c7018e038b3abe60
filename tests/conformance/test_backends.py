"""The built-in backends and the test fixture backend prove themselves with the kit.

Kernels run on the plain-torch path and on Triton (interpreted on the CPU), so both
kernel paths of ``paged`` and ``gdn`` are held to the same properties.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from kvrunner.testing.conformance import (
    CHECKS,
    ENGINE_CHECKS,
    GPU_PATH_ONLY,
    OVERLAP_PROMISE,
    Target,
    run_check,
)

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: the checks that drive a rig (the engine-level ones: test_batch_invariance_check.py)
RIG_CHECKS = [c for c in CHECKS if c not in ENGINE_CHECKS]
#: the checks a torch path (the CPU's, eager by design) is held to
EAGER_CHECKS = [c for c in RIG_CHECKS if c not in GPU_PATH_ONLY]


@pytest.mark.parametrize("check", EAGER_CHECKS)
@pytest.mark.parametrize("backend", ["paged", "gdn"])
def test_torch_path(backend: str, check: str) -> None:
    for target in Target.of(backend):
        assert 1 <= run_check(target, check, max_examples=6) <= 6


@pytest.mark.parametrize("check", EAGER_CHECKS)
@pytest.mark.parametrize("backend", ["paged", "gdn"])
def test_fp8_kv_on_the_torch_path(backend: str, check: str) -> None:
    """``kv_cache_dtype = "fp8"``: paged stores e4m3 (the references round keys and values
    the same way), gdn keeps its state; every property holds."""
    for target in Target.of(backend, kv_cache_dtype="fp8"):
        assert 1 <= run_check(target, check, max_examples=4) <= 4


# On CUDA only: Triton's interpreter rounds float32 to e4m3 ties-away-from-zero and
# makes no subnormals, so its stores differ from the reference's e4m3 rounding (the
# compiled store is the hardware cast; the torch path's kit run is in the fast tier).
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("check", RIG_CHECKS)
@pytest.mark.parametrize("backend", ["paged", "gdn"])
def test_fp8_kv_on_the_triton_path(backend: str, check: str) -> None:
    for target in Target.of(backend, use_triton=True, device="cuda", kv_cache_dtype="fp8"):
        assert 1 <= run_check(target, check, max_examples=2) <= 2


@pytest.mark.parametrize("check", RIG_CHECKS)
@pytest.mark.parametrize("backend", ["paged", "gdn"])
def test_triton_path(backend: str, check: str) -> None:
    for target in Target.of(backend, use_triton=True, device=TRITON_DEVICE):
        assert 1 <= run_check(target, check, max_examples=3) <= 3


@pytest.mark.parametrize("check", EAGER_CHECKS)
@pytest.mark.parametrize("backend", ["paged", "gdn"])
def test_with_tbo_on_top(backend: str, check: str) -> None:
    """Two-batch overlap cuts every step it can (sequences cut in two included); the
    layer backend under it must still pass every check."""
    for target in Target.of(backend, overlap="tbo"):
        assert 1 <= run_check(target, check, max_examples=4) <= 4


@pytest.mark.parametrize("check", sorted(GPU_PATH_ONLY))
@pytest.mark.parametrize("backend", ["paged", "gdn"])
def test_with_tbo_on_top_of_the_triton_path(backend: str, check: str) -> None:
    for target in Target.of(backend, use_triton=True, device=TRITON_DEVICE, overlap="tbo"):
        assert 1 <= run_check(target, check, max_examples=3) <= 3


def test_a_cuda_path_check_refuses_a_torch_path_target() -> None:
    """Not run and not passed: asked of the eager path, it says so."""
    (target,) = Target.of("paged")
    with pytest.raises(ValueError, match="use_triton=True"):
        run_check(target, sorted(GPU_PATH_ONLY)[0])


@pytest.mark.parametrize("check", EAGER_CHECKS)
def test_flatkv_fixture_backend(flatkv_installed, check: str) -> None:
    (target,) = Target.of("flatkv")
    assert 1 <= run_check(target, check, max_examples=6) <= 6


def test_an_overlap_promise_check_refuses_a_backend_that_makes_no_promise() -> None:
    """Not run and not passed: asked of a backend without ``supports_overlap``, it says so."""
    target = attrs.evolve(Target.of("paged")[0], supports_overlap=False)
    with pytest.raises(ValueError, match="supports_overlap promise"):
        run_check(target, sorted(OVERLAP_PROMISE)[0])
