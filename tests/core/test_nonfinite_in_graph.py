"""The non-finite check inside the decode graph finds what the check after the replay
finds, and counts only the step's real rows.

A decode graph that draws its step also checks it (``runner/capture/graph_sampling.py``,
``layers/nonfinite_rows.py``): it leaves the coded tokens for the host beside the
drawn ones and raises the count by its real rows' non-finite ones, never by a padded
row's. First the captured body itself, called eagerly as the CPU's stand-in graphs
call it, against the after-replay form and a plain-Python oracle over random NaN /
inf plantings in real and padded rows; then two engines whose graphs are padded (one
capture size, 4), one checking in the graph and one after the replay, over random
poisoned pushes: the same outputs and the same count.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrunner import LLM, SamplingParams
from kvrunner.engine.step_io import NONFINITE_CAUSES, SamplingColumns
from kvrunner.layers.fused.dispatch import kernels_chosen
from kvrunner.layers.nonfinite_rows import mark_nonfinite
from kvrunner.layers.sampler import sample
from kvrunner.layers.sampling_seeds import row_keys
from kvrunner.models.tiny import write_tiny_checkpoint
from kvrunner.runner.capture.graph_sampling import GraphSampling

VOCAB = 64
MAX_BATCH = 8
CODE = {cause: code for code, cause in NONFINITE_CAUSES.items()}
#: what a row is planted with, and the code the host must read for it (None: finite)
PLANTINGS = {
    "none": None,
    "nan": CODE["logits hold NaN"],
    "+inf": CODE["logits hold +inf"],
    "all -inf": CODE["every logit is -inf"],
    "one -inf": None,  # a masked token among finite ones is fine
}


def planted_logits(gen: torch.Generator, plantings: list[str], cols: list[int]) -> torch.Tensor:
    logits = torch.randn(len(plantings), VOCAB, generator=gen) * 3
    for row, (what, col) in enumerate(zip(plantings, cols, strict=True)):
        if what == "nan":
            logits[row, col] = float("nan")
        elif what == "+inf":
            logits[row, col] = float("inf")
        elif what == "all -inf":
            logits[row] = float("-inf")
        elif what == "one -inf":
            logits[row, col] = float("-inf")
    return logits


def drawable(params: SamplingParams) -> bool:
    return params.temperature == 0.0 or params.top_k in (0, VOCAB) and params.top_p >= 1.0


ROW = st.one_of(
    st.builds(SamplingParams, temperature=st.just(0.0)),
    st.builds(SamplingParams, temperature=st.floats(0.1, 2.0), seed=st.integers(0, 2**40)),
    st.builds(SamplingParams, temperature=st.just(1.0), seed=st.integers(0, 99),
              top_k=st.integers(1, VOCAB - 1)),  # a step the graph does not draw
)
STEP = st.integers(1, MAX_BATCH).flatmap(
    lambda rows: st.tuples(
        st.lists(ROW, min_size=1, max_size=rows),
        st.lists(st.sampled_from(list(PLANTINGS)), min_size=rows, max_size=rows),
        st.lists(st.integers(0, VOCAB - 1), min_size=rows, max_size=rows),
    )
)


@pytest.mark.parametrize("triton", [True, False], ids=["draws", "greedy-only"])
@given(steps=st.lists(STEP, min_size=1, max_size=4), seed=st.integers(0, 2**31))
def test_the_captured_check_codes_and_counts_what_the_check_after_the_replay_does(
    triton, steps, seed
) -> None:
    """Step after step on one set of buffers, each padded to its graph's rows with
    plantings in the padded rows too: where the graph draws the step, its coded
    tokens are the after-replay check's over the real rows, its drawn tokens are left
    as drawn, and the count rises by exactly the real rows planted non-finite; where it
    does not draw the step, the captured check counts nothing (the step is checked
    after the replay)."""
    gen = torch.Generator().manual_seed(seed)
    with kernels_chosen(triton_on_cpu=triton, fused_sampler=True):
        buffers = GraphSampling(max_batch=MAX_BATCH, vocab=VOCAB, device=torch.device("cpu"))
        count = torch.zeros((), dtype=torch.int64)
        for params, plantings, cols in steps:
            n, rows = len(params), len(plantings)
            logits = planted_logits(gen, plantings, cols)
            counts = list(range(n))
            columns = SamplingColumns.of(params)
            keys = row_keys(columns, list(range(n)), 7)
            drawn = buffers.stage(columns, lambda k=keys: k, counts, rows=rows)
            before = int(count)
            tokens, row_max, coded = buffers.sample_checked(logits, count)  # the graph's body
            greedy = all(p.temperature == 0.0 for p in params)
            assert drawn == (greedy or triton and all(drawable(p) for p in params))
            if not drawn:
                assert int(count) == before
                continue
            expected = [PLANTINGS[what] for what in plantings[:n]]
            assert int(count) - before == sum(code is not None for code in expected)
            after, after_count = mark_nonfinite(tokens[:n], row_max[:n])
            assert coded[:n].tolist() == after.tolist()
            assert int(after_count) == int(count) - before
            eager = sample(logits[:n], params, counts, keys=keys)
            for row, code in enumerate(expected):
                assert coded[row] == (eager.token_ids[row] if code is None else code), row
            assert tokens[:n].tolist() == eager.token_ids.tolist()  # kept as drawn


def test_a_capture_counts_nothing_even_where_the_last_step_counted_rows() -> None:
    """The rows the check counts are staged per step; the capture's forwards run with
    none staged (``StepLauncher.before_capture``)."""
    buffers = GraphSampling(max_batch=4, vocab=VOCAB, device=torch.device("cpu"))
    buffers.stage(SamplingColumns.of([SamplingParams(temperature=0.0)] * 3), list, [0] * 3,
                  rows=4)
    assert buffers.counted_rows.tolist() == [3]
    buffers.count_rows(0)
    count = torch.zeros((), dtype=torch.int64)
    buffers.sample_checked(torch.full((4, VOCAB), float("nan")), count)
    assert int(count) == 0


# -- two engines, padded graphs, the check in the graph and after the replay ----------

SMALL = dict(max_num_seqs=4, max_model_len=64, block_size=4, num_blocks=64, capture_sizes=[4])
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0, ignore_eos=True)
EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("nonfinite_graph") / "m")


@pytest.fixture(scope="module")
def engines(checkpoint) -> Iterator[tuple[LLM, LLM]]:
    """Two engines over one padded graph (size 4): the check in it, and after it."""
    in_graph = LLM(str(checkpoint), **SMALL)
    after = LLM(str(checkpoint), **SMALL)
    after.runner.launcher.nonfinite_check = "after_replay"
    after.recapture()
    assert in_graph.runner.graph_capture.graphs[4].output.coded is not None  # checked in the graph
    assert after.runner.graph_capture.graphs[4].output.coded is None  # checked after the replay
    yield in_graph, after
    in_graph.shutdown()
    after.shutdown()


@pytest.fixture(scope="module")
def clean(checkpoint) -> dict[str, torch.Tensor]:
    """The checkpoint's own tensors, pushed back after each poisoned run."""
    return safetensors.torch.load_file(str(checkpoint / "model.safetensors"))


def push(llm: LLM, name: str, tensor: torch.Tensor) -> None:
    llm.update_weights([(name, tensor)], check_finite=False)


def generate_poisoned(llm: LLM, clean, name: str, poisoned: torch.Tensor, batch):
    """``llm``'s outputs for ``batch`` with ``poisoned`` pushed as ``name``, the rows
    the engine ended for it (the host's count, ``cache_info``) and the rows the device
    counted (``runner.launcher.nan_rows``: also a row of a step launched before the host knew
    its request had ended, never a padded row)."""
    ended, counted = llm.cache_info().nonfinite_rows, llm.runner.launcher.nan_rows
    push(llm, name, poisoned)
    try:
        outs = llm.generate(batch, GREEDY)
    finally:
        push(llm, name, clean[name])
    return outs, llm.cache_info().nonfinite_rows - ended, llm.runner.launcher.nan_rows - counted


def summary(outs) -> list[tuple]:
    """What a request got; the error without its step (the engines' step counts differ)."""
    return [(o.token_ids, o.finish_reason, o.error and re.sub(r"^step \d+ ", "", o.error),
             o.logprobs) for o in outs]


@settings(max_examples=6)
@given(
    name=st.sampled_from(["lm_head.weight", EMBED, "model.norm.weight",
                          "model.layers.1.mlp.down_proj.weight"]),
    value=st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    where=st.floats(0.0, 1.0, exclude_max=True),
    batch=st.lists(st.lists(st.integers(3, 60), min_size=1, max_size=5), min_size=1,
                   max_size=3),
)
def test_an_engine_checking_in_its_padded_graphs_answers_as_one_checking_after_the_replay(
    engines, clean, name, value, where, batch
) -> None:
    in_graph, after = engines
    poisoned = clean[name].clone()
    poisoned.view(-1)[int(where * poisoned.numel())] = value
    outs, ended, counted = generate_poisoned(in_graph, clean, name, poisoned, batch)
    ref, ref_ended, ref_counted = generate_poisoned(after, clean, name, poisoned, batch)
    assert summary(outs) == summary(ref)
    failed = sum(o.finish_reason == "error" for o in outs)
    assert ended == ref_ended == failed
    assert counted == ref_counted >= failed
    assert all(math.isfinite(lp) for o in outs for lp in o.logprobs)


def test_nan_read_only_by_padded_rows_counts_nothing_and_changes_no_token(
    engines, clean
) -> None:
    """Token 0's embedding row is NaN: a padded row reads token 0, so every padded row
    of every replay is non-finite, and no real row is (no prompt or output holds 0)."""
    in_graph, _ = engines
    batch = [[5, 6, 7], [9, 10]]  # two real rows in a graph of four
    reference = in_graph.generate(batch, GREEDY)
    assert all(0 not in o.token_ids for o in reference)
    poisoned = clean[EMBED].clone()
    poisoned[0] = float("nan")
    outs, ended, counted = generate_poisoned(in_graph, clean, EMBED, poisoned, batch)
    assert (ended, counted) == (0, 0)
    assert [(o.token_ids, o.finish_reason) for o in outs] == [
        (o.token_ids, o.finish_reason) for o in reference
    ]
