"""The sm_90 compile report (``benchmarks/bench_prefill_compile.py``) compiles every
launch it lists, on a host without a GPU: a kernel's arguments changed without it
fails here, not on the next reader's run.

It runs in its own process without ``TRITON_INTERPRET`` (the tests set it, and an
interpreted kernel cannot be compiled).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _report(script: str) -> list[str]:
    """The script's printed lines, run without ``TRITON_INTERPRET``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, script], cwd=BENCHMARKS, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return [line for line in done.stdout.splitlines() if line.strip()]


def test_every_prefill_launch_compiles_for_sm90() -> None:
    lines = _report("bench_prefill_compile.py")
    assert not [line for line in lines if "FAILED" in line], lines
    # two launch tables x three query/pool dtypes x two GQA groups, each with its resources
    assert len([line for line in lines if "registers" in line]) == 12, lines
