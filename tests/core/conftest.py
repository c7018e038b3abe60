"""Fixtures for core tests: a private home for the embedded models, and a random
checkpoint of the Qwen3-0.6B shape for the GPU tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


@pytest.fixture
def kvrunner_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A private home for the embedded default models, written on first use."""
    monkeypatch.setenv("KVRUNNER_HOME", str(tmp_path / "home"))
    return str(tmp_path / "home")


@pytest.fixture(scope="module")
def qwen3_0_6b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bf16 checkpoint of the Qwen3-0.6B shape with random weights (written on the GPU:
    ``benchmarks/bench_e2e_decode.py``), positions up to 2,048."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from bench_e2e_decode import write_checkpoint

    path = tmp_path_factory.mktemp("q06") / "m"
    write_checkpoint(path, max_positions=2048)
    return path
