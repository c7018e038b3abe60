"""Fixtures for core tests: a private home for the embedded models."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def kvrunner_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A private home for the embedded default models, written on first use."""
    monkeypatch.setenv("KVRUNNER_HOME", str(tmp_path / "home"))
    return str(tmp_path / "home")
