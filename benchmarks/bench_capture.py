"""Capture time of the decode graphs on a cold Triton cache, by where the graph ends.

Each end (``[capture] decode_graph_ends_at``) is captured in a process of its own on
the 0.6B shape of ``bench_e2e_decode.py`` (the 20 default buckets), with an empty
Triton cache of its own, so every kernel its graphs hold is compiled during its
capture: ``tokens`` less ``logits`` is what the captured draw's compiles and
captures cost. Then a recapture (warm cache), as after a wake.

    python benchmarks/bench_capture.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_e2e_decode import BATCHES, decode_engine, write_checkpoint


def capture_once(path: Path, end: str) -> None:
    """This process's engine: its cold capture and a recapture, on one line."""
    llm = decode_engine(path, BATCHES, decode_graph_ends_at=end)
    cold, graphs = llm.runner.graph_capture.capture_seconds, len(llm.runner.graph_capture.graphs)
    warm = llm.recapture()
    print(f"{end:>13} {graphs:>6} {cold:>16.2f} {warm:>11.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", type=Path, help="(internal) capture once, from here")
    ap.add_argument("--end", default="tokens", help="(internal) where the graphs end")
    args = ap.parse_args()
    if args.checkpoint is not None:
        capture_once(args.checkpoint, args.end)
        return
    path = Path(tempfile.mkdtemp()) / "qwen3-0.6b-random"
    write_checkpoint(path)
    print(f"{'graph ends at':>13} {'graphs':>6} {'capture s (cold)':>16} {'recapture s':>11}",
          flush=True)
    for end in ("logits", "tokens"):
        env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="triton-"))
        subprocess.run([sys.executable, __file__, "--checkpoint", str(path), "--end", end],
                       env=env, check=True)


if __name__ == "__main__":
    main()
