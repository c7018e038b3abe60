"""A bf16 model's steps hand the sampler their logits in bf16 (unwidened): the
engine's tokens and logprobs are those of sampling the float32 widening."""

from __future__ import annotations

from kvrunner import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
MIXED = [
    SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=6, temperature=0.8, seed=7, ignore_eos=True, logprobs=1),
    SamplingParams(max_tokens=6, temperature=1.0, seed=8, top_k=20, ignore_eos=True),
]


def generate(force_widen: bool) -> tuple[list, set]:
    """The engine's outputs, and the ``widen`` values the runner asked for (with
    ``force_widen``, ``compute_logits`` widens whatever it is asked)."""
    asked: set = set()
    with LLM("tiny-qwen3", device="cpu", dtype="bfloat16", max_num_seqs=4,
             max_model_len=64) as llm:
        compute = llm.runner.model.compute_logits

        def spy(hidden, *, widen=True):
            asked.add(widen)
            return compute(hidden, widen=True if force_widen else widen)

        llm.runner.model.compute_logits = spy
        return llm.generate(PROMPTS, MIXED), asked


def test_bf16_logits_sample_as_their_float32_widening() -> None:
    got, asked = generate(force_widen=False)
    want, _ = generate(force_widen=True)
    assert asked == {False}  # the runner takes them unwidened
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.logprobs == w.logprobs and g.top_logprobs == w.top_logprobs
