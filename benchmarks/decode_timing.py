"""How the decode benchmarks time a run of ``LLM.generate``: decode ms per step, the
host's busy time a step, and the captured graph's replay time, on random prompts.

Shared by ``bench_e2e_decode.py`` (whose table these columns are), ``bench_graph_end.py``
and ``bench_moe.py``.
"""

from __future__ import annotations

import time

import torch

from kvrunner import LLM, SamplingParams
from kvrunner.runner.step.launched_step import LaunchedStep

#: prompt tokens, and new tokens a timed run generates
PROMPT, NEW = 128, 256
#: the vocabulary prompts are drawn from (Qwen3's)
VOCAB = 151936


def prompts(batch: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, PROMPT), generator=g).tolist()


def timed_generate(llm: LLM, batch: int, new: int, seed: int, *, seeded: bool = False,
                   unseeded: bool = False) -> float:
    """Seconds for ``new`` tokens of ``batch`` prompts: greedy, or each request drawing
    at temperature 1 with a seed of its own (``seeded``) or none (``unseeded``)."""
    if seeded:
        params = [SamplingParams(max_tokens=new, temperature=1.0, seed=seed * 1000 + i,
                                 ignore_eos=True) for i in range(batch)]
    elif unseeded:
        params = SamplingParams(max_tokens=new, temperature=1.0, ignore_eos=True)
    else:
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts(batch, seed), params)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def ours_step_ms(llm: LLM, batch: int, new: int = NEW, *, seeded: bool = False,
                 unseeded: bool = False) -> float:
    """Decode ms per step: (time for ``new`` tokens - time for 1 token) / (``new`` - 1)."""
    kw = {"seeded": seeded, "unseeded": unseeded}
    timed_generate(llm, batch, 4, seed=99, **kw)  # warm up every kernel at this batch
    full = timed_generate(llm, batch, new, seed=batch, **kw)
    prefill = timed_generate(llm, batch, 1, seed=batch + 1, **kw)
    return (full - prefill) / (new - 1) * 1e3


def host_busy_ms(llm: LLM, batch: int, new: int = NEW) -> tuple[float, float]:
    """Host time per decode step not spent waiting for the device: the wall time of a
    ``new``-token generate less the time blocked on each step's samples (the event
    wait in :meth:`LaunchedStep.result`), over the decode steps (the one-token run's
    subtracted, as in :func:`ours_step_ms`). Near the step time, the host sets it.

    Also the host time per step inside the graph launches (``graph.replay()``): from
    an idle queue a launch takes 5-20 µs, so more than that is the launch waiting for
    the device (the previous replay of the same graph), counted in the first figure.
    """
    waited, launching = [0.0], [0.0]
    original = LaunchedStep.result
    graphs = list(llm.runner.graph_capture.graphs.values())

    def timed_result(self):
        if self._event is not None:
            t0 = time.perf_counter()
            self._event.synchronize()
            waited[0] += time.perf_counter() - t0
        return original(self)

    def timed_launch(replay):
        def run():
            t0 = time.perf_counter()
            out = replay()
            launching[0] += time.perf_counter() - t0
            return out

        return run

    def busy(n: int, seed: int) -> tuple[float, float]:
        waited[0] = launching[0] = 0.0
        return timed_generate(llm, batch, n, seed) - waited[0], launching[0]

    LaunchedStep.result = timed_result
    for g in graphs:
        g.replay = timed_launch(g.replay)  # an instance attribute over the method
    try:
        (full, full_launch), (first, first_launch) = busy(new, batch + 3), busy(1, batch + 4)
    finally:
        LaunchedStep.result = original
        for g in graphs:
            del g.replay
    steps = new - 1
    return (full - first) / steps * 1e3, (full_launch - first_launch) / steps * 1e3


def graph_replay_ms(llm: LLM, batch: int, new: int = NEW) -> float:
    """Mean GPU time of the decode graph's replays during a real ``new``-token generate
    at ``batch``: the forward, the logits and the greedy draw (where the graph ends:
    ``runner/capture/graph_sampling.py``), without the step's preparation.

    CUDA events around every replay, read after the run: each replay sees the
    metadata of its own step (contexts growing from the prompt to prompt + new), so
    the mean is taken at the run's mean context, as the floor is. (Replaying a graph
    again afterwards would read whatever metadata the last step left.) Where the
    device waits for the host, the graph's launch latency falls inside the events.
    """
    graphs = list(llm.runner.graph_capture.graphs.values())
    pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def timed(replay):
        def run():
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            out = replay()
            end.record()
            pairs.append((start, end))
            return out

        return run

    for g in graphs:
        g.replay = timed(g.replay)  # an instance attribute over the method
    try:
        timed_generate(llm, batch, new, seed=batch + 2)
    finally:
        for g in graphs:
            del g.replay  # the method again
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) for start, end in pairs]
    return sum(times) / len(times)
