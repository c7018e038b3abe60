"""The README's main install has no Triton: ``tiny-qwen3-next`` (paged + gdn) still runs.

A fresh process in which ``import triton`` fails (a module of that name that raises,
first on the path) stands in for a virtual environment without it: what matters is
that nothing on the CPU path imports Triton, which this shows for every module the
rollout loads.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BLOCKER = 'raise ImportError("No module named \'triton\' (blocked by the test)")\n'


def test_rollout_of_the_hybrid_tiny_model_runs_without_triton(tmp_path: Path) -> None:
    blocked = tmp_path / "no_triton"
    (blocked / "triton").mkdir(parents=True)
    (blocked / "triton" / "__init__.py").write_text(BLOCKER)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"PYTHONPATH": os.pathsep.join([str(blocked), env.get("PYTHONPATH", "")]),
            "KVRUNNER_HOME": str(tmp_path / "home")}
    probe = subprocess.run([sys.executable, "-c", "import triton"], env=env,
                           capture_output=True, text=True)
    assert probe.returncode != 0 and "blocked by the test" in probe.stderr  # the stand-in works
    run = subprocess.run(
        [sys.executable, "-m", "kvrunner.cli.main", "rollout", "--model", "tiny-qwen3-next",
         "--rounds", "2", "--batch", "2", "--max-tokens", "4", "--max-num-seqs", "2",
         "--capture-sizes", "1,2", "-v"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, kvrunner_gdn.layer, kvrunner_paged.layer, "
         "kvrunner.runner.model_runner; print(sorted(m for m in sys.modules if m == 'triton' "
         "or m.startswith('triton.') or (m.startswith('kvrunner') and 'triton' in m)))"],
        env=env, capture_output=True, text=True,
    )
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]"
