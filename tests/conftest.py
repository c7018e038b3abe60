"""Shared test set-up: hypothesis profiles, the ``gpu`` marker, the Triton interpreter,
and test backends installed as real packages.

Profiles: ``ci`` (default, few examples, keeps CI fast) and ``thorough`` (many
examples): ``HYPOTHESIS_PROFILE=thorough pytest``.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

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

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


def pip_install_into(site: Path, package: Path) -> None:
    """``pip install --target site package`` (no dependencies, no build isolation)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(package)],
        check=True,
    )


def _installed(tmp_path_factory: pytest.TempPathFactory, package: Path):
    """``package`` pip-installed into a private site dir, on ``sys.path`` meanwhile."""
    site = tmp_path_factory.mktemp("site")
    pip_install_into(site, package)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    yield str(site)
    sys.path.remove(str(site))
    importlib.invalidate_caches()


@pytest.fixture(scope="session")
def flatkv_installed(tmp_path_factory: pytest.TempPathFactory) -> str:
    """tests/fixtures/flatkv_backend (backends ``flatkv`` and ``leaky``), installed."""
    yield from _installed(tmp_path_factory, FIXTURES / "flatkv_backend")


@pytest.fixture(scope="session")
def minimal_installed(tmp_path_factory: pytest.TempPathFactory) -> str:
    """examples/minimal_backend (backend ``minimal``, the docs' tutorial), installed."""
    yield from _installed(tmp_path_factory, ROOT / "examples" / "minimal_backend")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _kernel_choices_restored():
    """Every runner installs its config's ``[kernels]`` in its process (the layers ask the
    process); each test starts from the choices before it, whatever engine it built."""
    from kvrunner.layers.fused import dispatch

    before = dispatch.chosen_kernels()
    yield
    dispatch.choose_kernels(before)
