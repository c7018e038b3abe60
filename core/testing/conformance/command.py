"""``kvrunner check-backend NAME``: every conformance check on an installed backend."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import torch

from kvrunner.testing.conformance import CHECKS, Target, run_check


def check_backend(
    name: str, *, checks: Sequence[str] | None = None, examples: int = 8, use_triton: bool = False
) -> int:
    """Run the checks, one line each; exit status 0 when all pass, 1 otherwise."""
    unknown = sorted(set(checks or ()) - set(CHECKS))
    if unknown:
        print(f"kvrunner: unknown check(s) {unknown}; checks: {list(CHECKS)}", file=sys.stderr)
        return 2
    device = "cuda" if use_triton and torch.cuda.is_available() else "cpu"
    failed = 0
    for target in Target.of(name, use_triton=use_triton, device=device):
        for check in checks or CHECKS:
            start = time.perf_counter()
            try:
                run_check(target, check, max_examples=examples)
            except AssertionError as e:
                failed += 1
                print(f"FAIL {name} {target.layer_type} {check}\n{e}\n")
                continue
            print(f"ok   {name} {target.layer_type} {check} ({time.perf_counter() - start:.1f}s)")
    print(f"{name}: {'all checks passed' if not failed else f'{failed} check(s) failed'}")
    return 1 if failed else 0
