"""On CUDA: real decode graphs, replayed over planted NaN rows, check them in the graph.

Two engines with the same padded graphs (capture sizes 4 and 8), one checking in the
graph and one after the replay, greedy and seeded rows (both drawn in the graph):
the same tokens, errors and device count; a NaN that only padded rows read counts
nothing and changes no token; and the count a replay adds is read from the graph's
own memory, with no host work between the replay and the copy.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import safetensors.torch
import torch

from kvrunner import LLM, SamplingParams
from kvrunner.models.tiny import write_tiny_checkpoint

pytestmark = pytest.mark.gpu

SETTINGS = dict(dtype="float32", max_num_seqs=8, max_model_len=128, num_blocks=256,
                capture_sizes=[4, 8])
EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "q", kind="qwen3")


@pytest.fixture(scope="module")
def engines(checkpoint):
    in_graph = LLM(model=str(checkpoint), **SETTINGS)
    after = LLM(model=str(checkpoint), **SETTINGS)
    after.runner.launcher.nonfinite_check = "after_replay"
    after.recapture()
    for llm in (in_graph, after):
        captured = llm.runner.graph_capture.graphs
        assert all(g._graph is not None for g in captured.values()), "real CUDA graphs"
        assert llm.runner.launcher.graph_sampling.draws
    assert all(g.output.coded is not None for g in in_graph.runner.graph_capture.graphs.values())
    assert all(g.output.coded is None for g in after.runner.graph_capture.graphs.values())
    yield in_graph, after
    in_graph.shutdown()
    after.shutdown()


def params(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=10, temperature=0.0 if i % 2 else 0.8, seed=100 + i,
                           ignore_eos=True, logprobs=0) for i in range(n)]


def run_poisoned(llm: LLM, clean, poisoned, prompts):
    counted = llm.runner.launcher.nan_rows
    llm.update_weights([(EMBED, poisoned)], check_finite=False)
    try:
        outs = llm.generate(prompts, params(len(prompts)))
    finally:
        llm.update_weights([(EMBED, clean)])
    return outs, llm.runner.launcher.nan_rows - counted


def summary(outs) -> list[tuple]:
    """What a request got; the error without its step (the engines' step counts differ)."""
    return [(o.token_ids, o.finish_reason, o.error and re.sub(r"^step \d+ ", "", o.error))
            for o in outs]


def check_against_reference(prompts, reference, outs, bad: int) -> None:
    """A request that feeds ``bad`` ends with an error at the row after it, keeping the
    tokens before; every other request gets its clean tokens."""
    for prompt, ref, out in zip(prompts, reference, outs, strict=True):
        fed = list(prompt) + ref.token_ids[:-1]
        if bad not in fed:
            assert (out.token_ids, out.finish_reason) == (ref.token_ids, ref.finish_reason)
            continue
        first = max(fed.index(bad) - len(prompt) + 1, 0)
        assert out.finish_reason == "error" and out.token_ids == ref.token_ids[:first]
        assert out.error.endswith(f"(output token {first}): logits hold NaN")


def poison_and_compare(engines, checkpoint, prompts, pick: Callable[[list], int]) -> int:
    """NaN in the embedding row of token ``pick(clean outputs)``, on both engines: the
    same answers, the same device count (returned), each the clean run's up to the
    rows that feed that token."""
    in_graph, after = engines
    clean = safetensors.torch.load_file(str(checkpoint / "model.safetensors"))[EMBED].cuda()
    reference = in_graph.generate(prompts, params(len(prompts)))
    bad = pick(reference)
    poisoned = clean.clone()
    poisoned[bad] = float("nan")
    outs, counted = run_poisoned(in_graph, clean, poisoned, prompts)
    ref, ref_counted = run_poisoned(after, clean, poisoned, prompts)
    assert summary(outs) == summary(ref)
    assert counted == ref_counted >= sum(o.finish_reason == "error" for o in outs)
    check_against_reference(prompts, reference, outs, bad)
    return counted


@pytest.mark.parametrize("batch", [3, 5, 8])  # padded to 4, padded to 8, exact
def test_planted_nan_rows_in_replayed_graphs_match_the_check_after_the_replay(
    engines, checkpoint, batch
) -> None:
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, 400, (6,), generator=g).tolist() for _ in range(batch)]
    # request 0's output token 3, fed by a decode step (a replay)
    assert poison_and_compare(engines, checkpoint, prompts, lambda ref: ref[0].token_ids[3]) >= 1


def test_a_nan_only_padded_rows_read_is_not_counted_on_cuda(engines, checkpoint) -> None:
    """Token 0's embedding row: every padded row reads token 0 (a real row only where
    its request feeds it), and the after-replay check, which sees no padded row,
    counts the same."""
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14], [20, 21], [30], [31, 32]]  # 6 of 8
    poison_and_compare(engines, checkpoint, prompts, lambda ref: 0)
