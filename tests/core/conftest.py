"""Fixtures for core tests: a second backend installed as a real package."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(scope="session")
def flatkv_installed(tmp_path_factory: pytest.TempPathFactory) -> str:
    """pip-install tests/fixtures/flatkv_backend into a private site dir for this run."""
    site = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(FIXTURES / "flatkv_backend"),
        ],
        check=True,
    )
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    yield str(site)
    sys.path.remove(str(site))
    importlib.invalidate_caches()


@pytest.fixture
def kvrunner_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A private home for the embedded default models, written on first use."""
    monkeypatch.setenv("KVRUNNER_HOME", str(tmp_path / "home"))
    return str(tmp_path / "home")
