"""The built-in backends and the test fixture backend prove themselves with the kit.

Kernels run on the plain-torch path and on Triton (interpreted on the CPU), so both
kernel paths of ``paged`` and ``gdn`` are held to the same properties.
"""

from __future__ import annotations

import pytest
import torch

from kvrunner.testing.conformance import CHECKS, Target, run_check

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("backend", ["paged", "gdn"])
def test_torch_path(backend: str, check: str) -> None:
    for target in Target.of(backend):
        run_check(target, check, max_examples=6)


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("backend", ["paged", "gdn"])
def test_triton_path(backend: str, check: str) -> None:
    for target in Target.of(backend, use_triton=True, device=TRITON_DEVICE):
        run_check(target, check, max_examples=3)


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("backend", ["paged", "gdn"])
def test_with_tbo_on_top(backend: str, check: str) -> None:
    """Two-batch overlap cuts every step it can (sequences cut in two included); the
    layer backend under it must still pass every check."""
    for target in Target.of(backend, overlap="tbo"):
        run_check(target, check, max_examples=4)


@pytest.mark.parametrize("check", list(CHECKS))
def test_flatkv_fixture_backend(flatkv_installed, check: str) -> None:
    (target,) = Target.of("flatkv")
    run_check(target, check, max_examples=6)
