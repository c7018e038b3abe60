"""On CUDA: captured graphs replay exactly what eager computes, for every bucket.

fp32 so that padding a batch up to its bucket cannot flip a greedy choice through
rounding; the capture audit is on throughout, so every capture is also checked to
leave every pool byte-identical.
"""

from __future__ import annotations

import gc

import pytest
import torch

from kvrunner import LLM, SamplingParams
from kvrunner.models.tiny import write_tiny_checkpoint
from kvrunner.plugin_api import ForwardContext
from kvrunner.runner.capture.graphs import DecodeGraph

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SETTINGS = dict(dtype="float32", max_num_seqs=32, max_model_len=128, num_blocks=512, audit=True)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> str:
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "q", kind="qwen3"))


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [
        torch.randint(1, 400, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def test_every_bucket_replays_what_eager_computes(tiny_qwen3) -> None:
    graphs = LLM(model=tiny_qwen3, **SETTINGS)
    eager = LLM(model=tiny_qwen3, enforce_eager=True, **SETTINGS)
    assert graphs.runner.device.type == "cuda"
    captured = graphs.runner.graph_capture.graphs
    assert all(g._graph is not None for g in captured.values()), "real CUDA graphs"
    for batch in (1, 2, 3, 4, 7, 8, 9, 16, 17, 31, 32):  # every bucket, exact and padded
        ps = prompts(batch)
        assert [o.token_ids for o in graphs.generate(ps, GREEDY)] == [
            o.token_ids for o in eager.generate(ps, GREEDY)
        ], f"batch {batch}"
    assert graphs.runner.launcher.nan_rows == 0


def test_seeded_draws_in_the_graph_are_the_eager_engines(tiny_qwen3) -> None:
    """Greedy and seeded rows drawn inside the graph (graph_sampling.py): the tokens of
    the eager engine, the logprobs to float32 rounding, padded or not."""
    graphs = LLM(model=tiny_qwen3, **SETTINGS)
    eager = LLM(model=tiny_qwen3, enforce_eager=True, **SETTINGS)
    assert graphs.runner.launcher.graph_sampling.draws
    for batch in (1, 3, 8, 17):
        ps = prompts(batch)
        params = [SamplingParams(max_tokens=12, temperature=0.0 if i % 3 == 0 else 0.9,
                                 seed=1000 + i, ignore_eos=True, logprobs=1)
                  for i in range(batch)]
        got, want = graphs.generate(ps, params), eager.generate(ps, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], f"batch {batch}"
        for g, w in zip(got, want, strict=True):
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4), f"batch {batch}"


def test_recapture_after_serving_is_clean_and_outputs_repeat(tiny_qwen3) -> None:
    llm = LLM(model=tiny_qwen3, **SETTINGS)
    ps = prompts(5)
    first = [o.token_ids for o in llm.generate(ps, GREEDY)]
    llm.recapture()  # audit on: raises if any pool changed
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == first


def test_hf_parity_on_gpu(tiny_qwen3) -> None:
    transformers = pytest.importorskip("transformers")
    hf = (
        transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
        .cuda()
        .eval()
    )
    ps = prompts(6)
    expected = []
    for p in ps:
        ids = torch.tensor([p], device="cuda")
        out = hf.generate(
            ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0
        )
        expected.append(out[0, len(p) :].tolist())
    llm = LLM(model=tiny_qwen3, **SETTINGS)
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == expected


def test_bf16_generation_has_no_nan_rows(tiny_qwen3) -> None:
    llm = LLM(
        model=tiny_qwen3, dtype="bfloat16", max_num_seqs=16, max_model_len=128, num_blocks=1024,
        audit=True,  # the audit clones every pool: keep the pool small
    )
    outs = llm.generate(prompts(16), GREEDY)
    assert all(len(o.token_ids) == 12 for o in outs)
    assert llm.runner.launcher.nan_rows == 0


def test_no_garbage_collection_runs_inside_a_capture() -> None:
    """A dead cycle's finalizers may make CUDA calls a capture forbids (an engine dropped
    before this one aborted the process in a capture): automatic collection is off
    while the graph records, on for the warmup and again after."""
    seen: list[bool] = []

    def forward(rows: int, ctx: ForwardContext) -> torch.Tensor:
        seen.append(gc.isenabled())
        return torch.full((rows,), 2.0, device="cuda")

    graph = DecodeGraph(4, ForwardContext())
    graph.capture(forward, pool=None, device=torch.device("cuda"))
    assert seen == [True, False] and gc.isenabled()
    assert graph.replay().tolist() == [2.0] * 4
