"""What the non-finite check costs a decode step: in the graph, after the replay, or none.

A decode graph that draws its step also checks it for non-finite rows
(``layers/nonfinite_rows.py``, ``runner/capture/graph_sampling.py``): a few elementwise
kernels over ``[rows]`` inside the graph. ``StepLauncher.nonfinite_check`` moves the
check after the replay (the eager launches every step the graph does not draw
makes) or, for this benchmark only, turns it off. One engine on the Qwen3-0.6B
shape of ``bench_e2e_decode.py``, its graphs recaptured for each placement: decode
ms per step at batch 1, 64 and 256, greedy and seeded (both drawn in the graph),
the placements alternated round by round (medians of ``ROUNDS``), against the HBM
floor, and each placement's step over the unchecked one's.

    python benchmarks/bench_nonfinite_check.py
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from bench_e2e_decode import decode_engine, step_floor_ms, write_checkpoint
from common import copy_bandwidth_tbps
from decode_timing import ours_step_ms

BATCHES = (1, 64, 256)
PLACEMENTS = ("graph", "after_replay", "off")
SAMPLINGS = ("greedy", "seeded")
ROUNDS = 3


def main() -> None:
    path = Path(tempfile.mkdtemp()) / "qwen3-0.6b-random"
    weight_bytes = write_checkpoint(path)
    bw = copy_bandwidth_tbps() * 1e12
    # One graph per timed batch: a recapture per placement costs seconds, not minutes.
    llm = decode_engine(path, BATCHES, capture_sizes=list(BATCHES))
    launcher = llm.runner.launcher
    assert llm.runner.graph_capture.graph_end == "tokens" and launcher.graph_sampling.draws
    runs: dict[tuple[str, str, int], list[float]] = {}
    for round_ in range(ROUNDS):
        for placement in PLACEMENTS if round_ % 2 == 0 else reversed(PLACEMENTS):
            launcher.nonfinite_check = placement
            llm.recapture()
            graph = llm.runner.graph_capture.graphs[BATCHES[0]]
            assert (graph.output.coded is not None) == (placement == "graph")
            for b in BATCHES:
                for sampling in SAMPLINGS:
                    ms = ours_step_ms(llm, b, seeded=sampling == "seeded")
                    runs.setdefault((placement, sampling, b), []).append(ms)
                    print(f"round {round_} {placement:>12} {sampling:>6} batch {b:>3}: "
                          f"{ms:.3f} ms/step", flush=True)
    assert llm.runner.launcher.nan_rows == 0, "random weights gave a non-finite row"
    ms = {key: statistics.median(v) for key, v in runs.items()}
    print(f"\nmedians of {ROUNDS} rounds, ms per decode step\n"
          f"{'sampling':>8} {'batch':>5} {'floor':>7} "
          + " ".join(f"{p:>12}" for p in PLACEMENTS)
          + f" {'graph/off':>9} {'after/off':>9} {'graph/after':>11} {'graph x floor':>13}")
    for sampling in SAMPLINGS:
        for b in BATCHES:
            floor = step_floor_ms(weight_bytes, b, bw)
            graph, after, off = (ms[p, sampling, b] for p in PLACEMENTS)
            print(f"{sampling:>8} {b:>5} {floor:>7.3f} "
                  + " ".join(f"{ms[p, sampling, b]:>12.3f}" for p in PLACEMENTS)
                  + f" {graph / off:>9.3f} {after / off:>9.3f} {graph / after:>11.3f}"
                  f" {graph / floor:>13.2f}")


if __name__ == "__main__":
    main()
