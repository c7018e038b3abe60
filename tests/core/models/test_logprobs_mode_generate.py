"""An engine's ``logprobs_mode`` end to end: each sampled token's logprob and kept mass
equal the plain-torch reference computed from the raw logits the engine sampled it
from, on every path a row can take (drawn in the decode graph, drawn eagerly from the
graph's logits, a fully eager engine, with asynchronous steps or without), and the
engines agree with each other.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from logprobs_reference import reference

from kvrunner import LLM, SamplingParams
from kvrunner.layers.sampler import Sampler

pytest.importorskip("triton")

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
STEPS = 6


def params_for(greedy_graph: bool) -> list[SamplingParams]:
    """Four requests; with ``greedy_graph`` every decode step is one the graph draws
    (no row truncates), else the steps are drawn eagerly from the graph's logits."""
    common = dict(max_tokens=STEPS, ignore_eos=True, logprobs=3, return_kept_mass=True)
    if greedy_graph:
        return [
            SamplingParams(temperature=0.0, **common),
            SamplingParams(temperature=0.8, seed=7, **common),
            SamplingParams(temperature=1.3, **common),
            SamplingParams(temperature=0.6, seed=3, **common),
        ]
    return [
        SamplingParams(temperature=0.0, top_k=2, **common),
        SamplingParams(temperature=0.8, seed=7, top_k=5, top_p=0.7, **common),
        SamplingParams(temperature=1.3, min_p=0.05, top_p=0.9, **common),
        SamplingParams(temperature=0.6, seed=3, logit_bias={40: 3.0}, **common),
    ]


def generate(
    mode: str,
    params: list[SamplingParams],
    *,
    eager: bool,
    async_steps: bool = True,
    triton: bool = True,
):
    """The outputs, and every sampled row as the sampler saw it: ``(seq id, output
    index, raw logits row, whether a graph drew it)``."""
    seen: list[tuple[int, int, torch.Tensor, bool]] = []
    original = Sampler.sample_step_rows

    def spy(self, logits, step, *, drawn=None):
        rows = [i for i, wants in enumerate(step.sample) if wants]
        for j, i in enumerate(rows):
            seen.append(
                (step.seq_id[i], step.num_output_tokens[i], logits[j].clone(), drawn is not None)
            )
        return original(self, logits, step, drawn=drawn)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Sampler, "sample_step_rows", spy)
        with LLM(
            "tiny-qwen3",
            device="cpu",
            dtype="float32",
            max_num_seqs=4,
            max_model_len=64,
            enforce_eager=eager,
            triton_on_cpu=triton,
            async_scheduling=async_steps,
            logprobs_mode=mode,
        ) as llm:
            outputs = llm.generate(PROMPTS, params)
    return outputs, seen


def check_against_reference(mode: str, params: list[SamplingParams], outputs, seen) -> None:
    by_id = {out.request_id: (out, p) for out, p in zip(outputs, params, strict=True)}
    checked = 0
    for seq_id, index, logits, _ in seen:
        out, p = by_id[seq_id]
        if index >= len(out.token_ids):
            continue  # a token computed past the end (asynchronous steps): dropped
        ref = reference(logits, p)
        token = out.token_ids[index]
        assert out.logprobs[index] == pytest.approx(
            ref.values[mode][token].item(), rel=1e-5, abs=1e-4
        )
        assert out.kept_mass[index] == pytest.approx(ref.kept_mass, rel=1e-5, abs=1e-6)
        assert ref.kept[token]
        checked += 1
    assert checked == sum(len(o.token_ids) for o in outputs) == len(PROMPTS) * STEPS


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logits"])
def test_an_eager_engine_reports_what_the_reference_computes(mode) -> None:
    """The fast tier's engine: eager, on torch's sampler."""
    params = params_for(greedy_graph=False)
    outputs, seen = generate(mode, params, eager=True, triton=False)
    check_against_reference(mode, params, outputs, seen)


@pytest.mark.parametrize("greedy_graph", [True, False], ids=["drawn-in-graph", "drawn-eagerly"])
@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits", "raw_logprobs"])
def test_graphs_report_what_the_reference_computes_from_the_logits_they_saw(
    mode, greedy_graph
) -> None:
    params = params_for(greedy_graph)
    outputs, seen = generate(mode, params, eager=False)
    assert any(drawn for *_, drawn in seen) == greedy_graph
    check_against_reference(mode, params, outputs, seen)
    for out in outputs:
        assert len(out.kept_mass) == len(out.logprobs) == len(out.token_ids)


@pytest.mark.parametrize("greedy_graph", [True, False], ids=["graph-served", "truncating"])
def test_an_eager_engine_reports_what_an_engine_with_graphs_reports(greedy_graph) -> None:
    """The same tokens, processed logprobs, top logprobs and kept masses (to float32
    rounding: the logits of a graph and of an eager forward differ in their last bits)
    with graphs, eagerly, and eagerly without asynchronous steps."""
    params = params_for(greedy_graph)
    graphs, _ = generate("processed_logprobs", params, eager=False)
    for eager_outputs, eager_seen in (
        generate("processed_logprobs", params, eager=True),
        generate("processed_logprobs", params, eager=True, async_steps=False),
    ):
        check_against_reference("processed_logprobs", params, eager_outputs, eager_seen)
        for g, e in zip(graphs, eager_outputs, strict=True):
            assert g.token_ids == e.token_ids
            assert g.logprobs == pytest.approx(e.logprobs, abs=1e-4)
            assert g.kept_mass == pytest.approx(e.kept_mass, abs=1e-5)
            for gt, et in zip(g.top_logprobs, e.top_logprobs, strict=True):
                assert list(gt) == list(et)
                assert list(gt.values()) == pytest.approx(list(et.values()), abs=1e-4)


def test_the_mode_leaves_the_tokens_alone() -> None:
    """Only what is reported changes: every mode draws the same tokens."""
    params = params_for(greedy_graph=False)
    tokens = {
        mode: [o.token_ids for o in generate(mode, params, eager=True)[0]]
        for mode in ("raw_logprobs", "processed_logprobs")
    }
    assert tokens["raw_logprobs"] == tokens["processed_logprobs"]


def test_prompt_logprobs_stay_raw_in_a_processed_mode() -> None:
    """As vLLM's: a prompt is scored by the model alone, whatever the mode."""
    prompt_params = SamplingParams(max_tokens=2, temperature=0.5, top_k=2, prompt_logprobs=1)
    got = {}
    for mode in ("raw_logprobs", "processed_logprobs"):
        with LLM(
            "tiny-qwen3",
            device="cpu",
            dtype="float32",
            max_model_len=64,
            enforce_eager=True,
            logprobs_mode=mode,
        ) as llm:
            got[mode] = llm.generate([PROMPTS[2]], prompt_params)[0].prompt_logprobs
    assert got["processed_logprobs"] == got["raw_logprobs"]


def test_a_request_ended_by_a_stop_token_keeps_one_mass_per_token() -> None:
    """With asynchronous steps the step after the stop token was already launched: its
    token is dropped, and so is its kept mass."""
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=3, seed=5, ignore_eos=True,
                            return_kept_mass=True)  # fmt: skip
    with LLM("tiny-qwen3", device="cpu", dtype="float32", max_model_len=64,
             enforce_eager=True) as llm:  # fmt: skip
        whole = llm.generate([PROMPTS[0]], params)[0]
        stop = whole.token_ids[2]
        cut = llm.generate([PROMPTS[0]], attrs.evolve(params, stop_token_ids=(stop,)))[0]
    ends = whole.token_ids.index(stop) + 1
    assert cut.token_ids == whole.token_ids[:ends]
    assert cut.kept_mass == whole.kept_mass[:ends]
