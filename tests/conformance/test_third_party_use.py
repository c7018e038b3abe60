"""A third party's own test suite runs the kit: as a generated suite and as a fixture."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SUITE = '''
from kvrunner.testing.conformance import conformance_suite

test_paged = conformance_suite("paged", max_examples=1,
                               checks=["step_matches_reference", "replay_sees_later_fill"])
'''

CONFTEST = '''
pytest_plugins = ["kvrunner.testing.conformance.pytest_plugin"]
'''

FIXTURE = '''
def test_paged_conforms(backend_conformance):
    backend_conformance("paged", "write_targets_pad_past_live_rows")
'''


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
         str(folder), str(folder), *args],
        cwd=folder, env=env, capture_output=True, text=True, timeout=600,
    )


def test_a_generated_suite_runs_one_test_per_layer_type_and_check(tmp_path: Path) -> None:
    (tmp_path / "test_mine.py").write_text(SUITE)
    run = _pytest(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 passed" in run.stdout


def test_the_pytest_plugin_gives_a_fixture(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_mine.py").write_text(FIXTURE)
    run = _pytest(tmp_path, "--kvrunner-examples", "2")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout
