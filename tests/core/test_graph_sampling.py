"""The decode graph's own sampling: it draws exactly what the eager sampler draws.

A decode graph ends with the logits and, for a step where no row filters by top-k /
top-p, the tokens (``runner/capture/graph_sampling.py``), each drawing row keyed by its own
seed or, unseeded, by the engine's key for its request. The staged
buffers and the captured draw are checked against the eager sampler over sequences
of steps (a step's temperatures must never leak into the next), with padded rows;
then a whole engine with graphs against one without.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvrunner import LLM, SamplingParams
from kvrunner.config import ConfigError, EngineConfig
from kvrunner.engine.step_io import SamplingColumns
from kvrunner.layers.fused.dispatch import kernels_chosen
from kvrunner.layers.sampler import Sampler, sample
from kvrunner.layers.sampling_seeds import row_keys
from kvrunner.runner.capture.graph_sampling import GraphSampling

pytest.importorskip("triton")
VOCAB = 300
GREEDY = st.builds(SamplingParams, temperature=st.just(0.0),
                   logprobs=st.sampled_from([None, 0, 2]))
SEEDED = st.builds(SamplingParams, temperature=st.floats(0.1, 2.0),
                   seed=st.integers(-(2**63), 2**63 - 1), logprobs=st.sampled_from([None, 1]),
                   top_k=st.sampled_from([0, VOCAB]))  # top_k = vocabulary filters nothing
UNSEEDED = st.builds(SamplingParams, temperature=st.floats(0.1, 2.0),
                     logprobs=st.sampled_from([None, 1]))
EAGER_ONLY = st.one_of(
    st.builds(SamplingParams, temperature=st.just(1.0), seed=st.integers(0, 99),
              top_k=st.integers(1, VOCAB - 1)),
    st.builds(SamplingParams, temperature=st.just(1.0), seed=st.integers(0, 99),
              top_p=st.floats(0.1, 0.95)),
)
STEP = st.lists(st.one_of(GREEDY, SEEDED, UNSEEDED, EAGER_ONLY), min_size=1, max_size=5)


def graph_serves(params: list[SamplingParams], *, draws: bool) -> bool:
    greedy = [p.temperature == 0.0 for p in params]
    unfiltered = [p.top_k in (0, VOCAB) and p.top_p >= 1.0 for p in params]
    return all(greedy) or draws and all(g or u for g, u in zip(greedy, unfiltered, strict=True))


@pytest.mark.parametrize("triton", [True, False])
@given(steps=st.lists(STEP, min_size=1, max_size=4), pad=st.integers(0, 3),
       seed=st.integers(0, 2**31), engine_seed=st.integers(-(2**63), 2**63 - 1))
def test_a_staged_step_draws_the_eager_samplers_tokens(
    triton, steps, pad, seed, engine_seed
) -> None:
    """Step after step on one set of buffers, each padded to its graph's batch: where
    the graph serves the step, its tokens and maxima are the eager sampler's with the
    same keys; where it does not, it says so. Without Triton only greedy steps are
    served."""
    gen = torch.Generator().manual_seed(seed)
    with kernels_chosen(triton_on_cpu=triton, fused_sampler=True):
        buffers = GraphSampling(max_batch=8, vocab=VOCAB, device=torch.device("cpu"))
        assert buffers.draws == triton
        for params in steps:
            n = len(params)
            logits = torch.randn(n + pad, VOCAB, generator=gen) * 3
            counts = torch.randint(0, 10**4, (n,), generator=gen).tolist()
            seq_ids = torch.randperm(50, generator=gen)[:n].tolist()
            columns = SamplingColumns.of(params)
            keys = row_keys(columns, seq_ids, engine_seed)
            served = buffers.stage(columns, lambda k=keys: k, counts, rows=n + pad)
            tokens, row_max = buffers.sample(logits)  # what the graph replays
            assert served == graph_serves(params, draws=triton)
            if served:
                eager = sample(logits[:n], params, counts, keys=keys)
                assert tokens[:n].tolist() == eager.token_ids.tolist()
                assert torch.equal(row_max[:n], eager.row_max)


def test_a_greedy_step_after_a_drawing_one_draws_nothing() -> None:
    """The temperatures a step staged are cleared when the next step is all greedy:
    every row takes its argmax again."""
    with kernels_chosen(triton_on_cpu=True):
        buffers = GraphSampling(max_batch=4, vocab=50, device=torch.device("cpu"))
        logits = torch.randn(4, 50)
        assert buffers.stage(SamplingColumns.of(SamplingParams(temperature=5.0, seed=s)
                                                for s in range(4)),
                             lambda: [0, 1, 2, 3], [0] * 4, rows=4)
        drawn, _ = buffers.sample(logits)
        assert buffers.stage(SamplingColumns.of([SamplingParams(temperature=0.0)] * 4), list,
                             [0] * 4, rows=4)
        greedy, _ = buffers.sample(logits)
    assert greedy.tolist() == logits.argmax(dim=-1).tolist() != drawn.tolist()


def generate(*, eager: bool, params: list[SamplingParams],
             graph_end: str = "tokens") -> tuple[list, list[bool]]:
    """The engine's outputs, and for each step it sampled whether the graph drew it."""
    drawn_in_graph: list[bool] = []
    original = Sampler.sample_step_rows

    def spy(self, logits, step, *, drawn=None):
        drawn_in_graph.append(drawn is not None)
        return original(self, logits, step, drawn=drawn)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Sampler, "sample_step_rows", spy)
        with LLM("tiny-qwen3", device="cpu", dtype="float32", max_num_seqs=4,
                 max_model_len=64, enforce_eager=eager, triton_on_cpu=True,
                 decode_graph_ends_at=graph_end) as llm:
            outputs = llm.generate([[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]], params)
    return outputs, drawn_in_graph


MIXED = [
    SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=4, temperature=0.8, seed=7, ignore_eos=True, logprobs=1),
    SamplingParams(max_tokens=6, temperature=1.3, seed=8, ignore_eos=True),
]


@pytest.mark.parametrize("end", ["tokens", "logits", "hidden"])
def test_an_engine_with_graphs_draws_what_an_eager_one_draws(end) -> None:
    """Three requests padded to a graph of 4 (one ends early): the same tokens, and the
    same logprobs to float32 rounding, wherever the graph ends; ending at the tokens,
    every decode step is drawn in the graph, and nothing else is."""
    want, eager_drawn = generate(eager=True, params=MIXED, graph_end=end)
    got, graph_drawn = generate(eager=False, params=MIXED, graph_end=end)
    assert not any(eager_drawn)
    assert any(graph_drawn) == (end == "tokens")
    if end == "tokens":  # the prefill step samples eagerly, every decode step in the graph
        assert graph_drawn == [False] + [True] * (len(graph_drawn) - 1)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert (g.logprobs is None) == (w.logprobs is None)
        if w.logprobs is not None:
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)


def test_unseeded_draws_are_drawn_in_the_graph_as_the_eager_engine_draws_them() -> None:
    """Unseeded rows are keyed by the engine (its seed, the request id), so the graph
    draws them too: every decode step in the graph, the eager engine's tokens. A top-p
    row sends its steps to the eager sampler, with the same tokens again."""
    unseeded = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True, logprobs=1)
    params = [MIXED[0], unseeded, SamplingParams(max_tokens=6, temperature=0.7,
                                                 ignore_eos=True)]  # fmt: skip
    want, _ = generate(eager=True, params=params)
    got, graph_drawn = generate(eager=False, params=params)
    assert graph_drawn == [False] + [True] * (len(graph_drawn) - 1)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    top_p = [*params[:2], SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9,
                                         ignore_eos=True)]  # fmt: skip
    want, _ = generate(eager=True, params=top_p)
    got, graph_drawn = generate(eager=False, params=top_p)
    assert not any(graph_drawn)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_where_the_graph_ends_is_checked() -> None:
    with pytest.raises(ConfigError, match="decode_graph_ends_at must be one of tokens, logits, "
                                          "hidden; got 'sampler'"):
        EngineConfig.load(decode_graph_ends_at="sampler")

