"""``kvrunner check-backend NAME``: every conformance check on an installed backend."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import torch

from kvrunner.plugin_api.factory import declares_overlap_support
from kvrunner.plugin_host.plugins import discover_backends
from kvrunner.testing.conformance import CHECKS, Target, not_run_because, run_check


def check_backend(
    name: str, *, checks: Sequence[str] | None = None, examples: int = 8, use_triton: bool = False,
    overlap: str | None = None, kv_cache_dtype: str = "auto",
) -> int:
    """Run the checks, one line each; exit status 0 when all pass, 1 otherwise.
    ``kv_cache_dtype``: the backend built with it (the references round keys and values
    as an FP8 pool does).

    ``overlap``: with that overlap plugin on top of the layer backend ``name``. An
    overlap plugin is itself checked that way, over every installed layer backend.
    """
    unknown = sorted(set(checks or ()) - set(CHECKS))
    if unknown:
        print(f"kvrunner: unknown check(s) {unknown}; checks: {list(CHECKS)}", file=sys.stderr)
        return 2
    found = discover_backends()
    if name in found and getattr(found[name].load(), "plugin_role", "layers") == "overlap":
        layers = [n for n, b in sorted(found.items())
                  if getattr(b.load(), "plugin_role", "layers") != "overlap"]
        refused = [n for n in layers if not declares_overlap_support(found[n].load())]
        layers = [n for n in layers if n not in refused]
        print(f"{name} is an overlap plugin: checking it on top of {', '.join(layers)}")
        if refused:
            print(f"not over {', '.join(refused)}: they do not declare supports_overlap")
        return max((check_backend(layer, checks=checks, examples=examples,
                                  use_triton=use_triton, overlap=name,
                                  kv_cache_dtype=kv_cache_dtype) for layer in layers),
                   default=1)
    device = "cuda" if use_triton and torch.cuda.is_available() else "cpu"
    failed = skipped = 0
    label = f"{name}+{overlap}" if overlap else name
    try:
        targets = Target.of(name, use_triton=use_triton, device=device, overlap=overlap,
                            kv_cache_dtype=kv_cache_dtype)
    except Exception as e:  # a backend that does not load fails every check, said once
        print(f"FAIL {label} load\n{_one_line(e)}\n")
        print(f"{label}: the backend did not load; no check ran")
        return 1
    for target in targets:
        for check in checks or CHECKS:
            reason = not_run_because(target, check)
            if reason is not None:
                print(f"skip {label} {target.layer_type} {check} ({reason})")
                skipped += 1
                continue
            start = time.perf_counter()
            try:
                run_check(target, check, max_examples=examples)
            except AssertionError as e:
                failed += 1
                print(f"FAIL {label} {target.layer_type} {check}\n{e}\n")
                continue
            except Exception as e:  # a hook or forward that raised fails this check only
                failed += 1
                print(f"FAIL {label} {target.layer_type} {check}\n{_one_line(e)}\n")
                continue
            print(f"ok   {label} {target.layer_type} {check} ({time.perf_counter() - start:.1f}s)")
    verdict = "all checks passed" if not failed else f"{failed} check(s) failed"
    if skipped:
        verdict += f", {skipped} not run (listed above, with why)"
    print(f"{label}: {verdict}")
    return 1 if failed else 0


def _one_line(error: BaseException) -> str:
    """An exception as its type and message (hypothesis groups: each distinct one)."""
    if isinstance(error, BaseExceptionGroup):
        return "\n".join(dict.fromkeys(_one_line(e) for e in error.exceptions))
    return f"{type(error).__name__}: {error}"
