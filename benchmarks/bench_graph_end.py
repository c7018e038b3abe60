"""Where the decode graph ends: the forward alone, + the logits, + the draw.

``[capture] decode_graph_ends_at`` (``runner/capture/graph_sampling.py``) at ``hidden``,
``logits`` and ``tokens`` (the default), one engine each, on the Qwen3-0.6B shape of
``bench_e2e_decode.py``: decode ms per step at batch 1, 64 and 256, greedy and with
every request at temperature 1, seeded or unseeded (both drawn in the graph at
``tokens``: an unseeded request is keyed by the engine), against the
HBM floor, and each end's step against ``hidden``'s. The ends differ only in where the
logits' and the sampler's launches happen, so the figures are launch gaps and host
work, measured in one run.

``shared`` draws unseeded requests without the engine's keys: every step with an
unseeded row sampled eagerly after the graph, on the torch path, from the engine's
one generator (patched in for this row only), the cost keying them removes.

    python benchmarks/bench_graph_end.py
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import attrs
from bench_e2e_decode import decode_engine, release_memory, step_floor_ms, write_checkpoint
from common import copy_bandwidth_tbps
from decode_timing import ours_step_ms

from kvrunner.cli.help import choices_of
from kvrunner.config import CaptureConfig
from kvrunner.engine.step_io import SamplingColumns
from kvrunner.layers.sampler import Sampler, sample_step_rows
from kvrunner.runner.step_launch import StepLauncher

BATCHES = (1, 64, 256)
SAMPLINGS = ("greedy", "seeded", "unseeded", "shared")

#: where a decode graph may end (the config field's choices): tokens, logits, hidden
GRAPH_ENDS = choices_of(attrs.fields(CaptureConfig).decode_graph_ends_at)


@contextmanager
def shared_generator_draws() -> Iterator[None]:
    """Unseeded rows drawn without keys: the graph draws no step that holds one, and
    the eager sampler takes them from its one generator."""
    stage, step_rows = StepLauncher._stage_graph_draws, Sampler.sample_step_rows

    def stage_keyed_only(self, step, graph):
        sampling = step.sampling
        if (~sampling.has_seed & sampling.drawing).any():
            if self.graph_sampling is not None:  # clear any temperatures staged before
                self.graph_sampling.stage(SamplingColumns.of([]), list, [], rows=0)
            return False
        return stage(self, step, graph)

    def from_generator(self, logits, step, *, drawn=None):
        return sample_step_rows(logits, step, drawn=drawn,
                                generator=self._generator_for(logits.device))

    StepLauncher._stage_graph_draws = stage_keyed_only
    Sampler.sample_step_rows = from_generator
    try:
        yield
    finally:
        StepLauncher._stage_graph_draws, Sampler.sample_step_rows = stage, step_rows


def main() -> None:
    path = Path(tempfile.mkdtemp()) / "qwen3-0.6b-random"
    weight_bytes = write_checkpoint(path)
    bw = copy_bandwidth_tbps() * 1e12
    ms: dict[tuple[str, str, int], float] = {}
    for end in reversed(GRAPH_ENDS):  # hidden first: the reference
        llm = decode_engine(path, BATCHES, decode_graph_ends_at=end)
        assert llm.runner.graph_capture.graph_end == end
        for b in BATCHES:
            for sampling in SAMPLINGS:
                with shared_generator_draws() if sampling == "shared" else nullcontext():
                    ms[end, sampling, b] = ours_step_ms(
                        llm, b, seeded=sampling == "seeded",
                        unseeded=sampling in ("unseeded", "shared"))
                print(f"{end:>6} {sampling:>8} batch {b:>3}: {ms[end, sampling, b]:.3f} ms/step",
                      flush=True)
        del llm
        release_memory()
    print(f"\n{'sampling':>8} {'batch':>5} {'floor ms':>8} "
          + " ".join(f"{e + ' ms':>10} {'x floor':>7}" for e in reversed(GRAPH_ENDS))
          + f" {'tokens/hidden':>13}")
    for sampling in SAMPLINGS:
        for b in BATCHES:
            floor = step_floor_ms(weight_bytes, b, bw)
            cells = " ".join(f"{ms[e, sampling, b]:>10.3f} {ms[e, sampling, b] / floor:>7.2f}"
                             for e in reversed(GRAPH_ENDS))
            ratio = ms["tokens", sampling, b] / ms["hidden", sampling, b]
            print(f"{sampling:>8} {b:>5} {floor:>8.3f} {cells} {ratio:>13.3f}")
    print(f"\nunseeded, keyed by the engine against drawn from the shared generator\n"
          f"{'batch':>5} " + " ".join(f"{e + ' keyed/shared':>20}" for e in reversed(GRAPH_ENDS)))
    for b in BATCHES:
        print(f"{b:>5} " + " ".join(f"{ms[e, 'unseeded', b] / ms[e, 'shared', b]:>20.3f}"
                                     for e in reversed(GRAPH_ENDS)))


if __name__ == "__main__":
    main()
