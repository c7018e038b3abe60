"""Shared test set-up: hypothesis profiles, the ``gpu`` marker, the Triton interpreter.

Profiles: ``ci`` (default, few examples, keeps CI fast) and ``thorough`` (many
examples): ``HYPOTHESIS_PROFILE=thorough pytest``.
"""

from __future__ import annotations

import os

# Without CUDA, Triton kernels run under the interpreter; this must be set before
# triton is first imported anywhere.
try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Two cores: torch's intra-op threads only contend on the tiny shapes tests use.
    torch.set_num_threads(1)

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
