"""Trainer-aligned mode: a transformers model after ``kvrunner.aligned.align`` gives every
sampled token (and every prompt token) the logprob the deterministic engine returned,
bit for bit, on the embedded tiny Qwen3 and Qwen3-MoE checkpoints in float32 and
bfloat16, whatever the trainer's batch: each sample alone, all of them left- or
right-padded together, or reordered among a longer stranger.

Leaving one op on transformers' own computation (``transformers_ops``) breaks the
equality; each op is shown breaking it in a case where its computation differs from
the engine's on the CPU (the norms and the activation are the same torch code on the
CPU; ``test_aligned_triton_path.py`` shows them breaking it on the Triton path).
"""

from __future__ import annotations

import pytest
import torch

from kvrunner import LLM, SamplingParams
from kvrunner.aligned import align, token_logprobs
from kvrunner.models.tiny import write_tiny_checkpoint

transformers = pytest.importorskip("transformers")

PROMPTS = [
    [3, 17, 29, 101, 55, 66, 77, 88, 99, 5, 6, 7, 8, 40, 41],
    [7, 8, 9],
    [200, 201, 5],
    [12, 13, 14, 15, 16, 17, 18, 19],
]
MAX_TOKENS = [6, 9, 1, 4]
#: a sequence no sample shares, longer than every sample
STRANGER = list(range(30, 60))


class Rollout:
    """One engine run: each sample's prompt, sampled tokens and logprobs."""

    def __init__(self, path, dtype: str, **engine) -> None:
        # chunks of 8 tokens, blocks of 4: prompts are prefilled in pieces
        llm = LLM(str(path), dtype=dtype, deterministic=True, block_size=4,
                  max_num_batched_tokens=8, max_num_seqs=4, **engine)
        try:
            params = [SamplingParams(max_tokens=n, temperature=1.0, seed=11 + i, logprobs=0,
                                     prompt_logprobs=0, ignore_eos=True)
                      for i, n in enumerate(MAX_TOKENS)]
            outs = llm.generate(PROMPTS, params)
            self.config = llm.config
        finally:
            llm.shutdown()
        self.sequences = [p + list(o.token_ids) for p, o in zip(PROMPTS, outs, strict=True)]
        # the engine's logprob of every token after the first: the prompt's as it scored
        # them, then the sampled ones' as generation returned them
        self.logprobs = [torch.tensor(o.prompt_logprobs[1:] + o.logprobs, dtype=torch.float32)
                         for o in outs]


CASES = [(kind, dtype) for kind in ("qwen3", "qwen3-moe") for dtype in ("float32", "bfloat16")]


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    """``get(kind, dtype)``: the checkpoint and its engine run, each made once."""
    made: dict[tuple[str, str], tuple] = {}

    def get(kind: str, dtype: str, **engine) -> tuple:
        key = (kind, dtype, *sorted(engine))
        if key not in made:
            path = write_tiny_checkpoint(tmp_path_factory.mktemp(kind) / "m", kind=kind)
            made[key] = path, dtype, Rollout(path, dtype, **engine)
        return made[key]

    return get


def trainer_model(path, dtype: str, engine, **options):
    """The checkpoint as a trainer loads it, aligned to ``engine``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return align(model, engine, **options)


def score(model, sequences: list[list[int]], *, left: bool, extra: int = 0) -> list[torch.Tensor]:
    """Every sequence's per-token logprobs (tokens 1..n) from one padded forward."""
    width = max(map(len, sequences)) + extra
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        cols = slice(width - len(seq), width) if left else slice(0, len(seq))
        ids[row, cols] = torch.tensor(seq)
        mask[row, cols] = 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    out = []
    for row, seq in enumerate(sequences):
        first = width - len(seq) if left else 0
        rows = logits[row, first : first + len(seq) - 1]
        out.append(token_logprobs(rows, torch.tensor(seq[1:])))
    return out


def compositions(sequences: list[list[int]], model) -> dict[str, list[torch.Tensor]]:
    """The same sequences scored in four trainer batches."""
    n = len(sequences)
    reordered = score(model, [STRANGER, *sequences[::-1]], left=False)[1:][::-1]
    return {
        "alone": [score(model, [s], left=False)[0] for s in sequences],
        "left-padded": score(model, sequences, left=True),
        "right-padded, wider than needed": score(model, sequences, left=False, extra=5),
        "reordered beside a stranger": reordered[:n],
    }


@pytest.mark.parametrize(("kind", "dtype"), CASES)
def test_aligned_logprobs_equal_the_engines_bit_for_bit(rollouts, kind, dtype) -> None:
    path, _, run = rollouts(kind, dtype)
    model = trainer_model(path, dtype, run.config)
    for name, scored in compositions(run.sequences, model).items():
        for i, (got, want) in enumerate(zip(scored, run.logprobs, strict=True)):
            assert torch.equal(got, want), (
                f"{name}, sample {i}: {int((got != want).sum())} of {len(want)} tokens differ, "
                f"max {float((got - want).abs().max()):.3g}")


def test_the_engines_fp32_lm_head_and_router_logits_are_followed(rollouts) -> None:
    """An engine with ``fp32_lm_head`` and ``fp32_router_logits`` (bf16 weights): the
    aligned trainer takes both products in float32 too, from the engine's config."""
    switches = dict(fp32_lm_head=True, fp32_router_logits=True)
    path, dtype, run = rollouts("qwen3-moe", "bfloat16", **switches)
    model = trainer_model(path, dtype, run.config)
    for got, want in zip(score(model, run.sequences, left=True), run.logprobs, strict=True):
        assert torch.equal(got, want)
    # aligned to an engine without the switches, the trainer misses those bits
    plain = trainer_model(path, dtype, rollouts("qwen3-moe", "bfloat16")[2].config)
    assert any(not torch.equal(got, want) for got, want in zip(
        score(plain, run.sequences, left=True), run.logprobs, strict=True))


#: for each op, a case where transformers' own computation of it differs on the CPU
BREAKS = {
    "linear": ("qwen3", "float32"),  # one batched GEMM, not one product per row
    "attention": ("qwen3", "float32"),  # SDPA, not the fixed order
    "lm_head": ("qwen3", "float32"),
    "rotary": ("qwen3", "bfloat16"),  # cos/sin rounded to bf16 and rotated in bf16
    "moe": ("qwen3-moe", "float32"),  # experts added expert by expert, not slot by slot
}


@pytest.mark.parametrize("op", sorted(BREAKS))
def test_leaving_one_op_on_transformers_breaks_the_equality(rollouts, op) -> None:
    path, dtype, run = rollouts(*BREAKS[op])
    model = trainer_model(path, dtype, run.config, transformers_ops=[op])
    scored = score(model, run.sequences, left=True)
    assert any(not torch.equal(got, want) for got, want in zip(scored, run.logprobs,
                                                                strict=True)), op
