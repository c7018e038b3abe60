"""Deterministic mode on CUDA (bf16, decode graphs, asynchronous steps): a probe
request's tokens and logprobs are bit for bit those it gets alone, in crowds of other
requests, at the Qwen3-0.6B shape (greedy and seeded) and on the tiny MoE; scoring
its prompt and output reproduces generation's logprobs; a sleep/wake in between
changes nothing; the hybrid model is refused. Under them: the invariant products give
a row the same bits at every row count and in every layout of one reduction."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvrunner import LLM, SamplingParams
from kvrunner.models.tiny import write_tiny_checkpoint
from kvrunner.plugin_api.errors import BackendError

pytestmark = pytest.mark.gpu

ENGINE = dict(dtype="bfloat16", max_num_seqs=48, max_model_len=640, block_size=16,
              gpu_memory_utilization=0.4, deterministic=True)


def crowd(seed: int, n: int, vocab: int = 5000) -> list[list[int]]:
    """``n`` random prompts of 3 to 299 token ids below ``vocab``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (int(k),), generator=g).tolist()
            for k in torch.randint(3, 300, (n,), generator=g)]


def check(path: Path, params: SamplingParams, **extra) -> None:
    with LLM(str(path), **ENGINE, **extra) as llm:
        vocab = min(5000, llm.engine.vocab_size)  # the tiny MoE has 448 ids
        probe = crowd(1, 1, vocab)[0][:40] + list(range(100, 140))
        alone = llm.generate([probe], params)[0]
        for seed, n, at in ((2, 26, 0), (3, 40, 17), (4, 9, 9)):
            others = crowd(seed, n, vocab)
            batch = others[:at] + [probe] + others[at:]
            sp = [SamplingParams(max_tokens=8 + 3 * i % 40, temperature=1.0) for i in range(n)]
            out = llm.generate(batch, sp[:at] + [params] + sp[at:])[at]
            assert (out.token_ids, out.logprobs, out.top_logprobs) == (
                alone.token_ids, alone.logprobs, alone.top_logprobs)
        llm.sleep(1)
        llm.wake_up()
        again = llm.generate([probe] + crowd(5, 12, vocab), [params] + [SamplingParams()] * 12)[0]
        assert (again.token_ids, again.logprobs) == (alone.token_ids, alone.logprobs)
        scored = llm.generate([probe + alone.token_ids],
                              SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        assert scored.prompt_logprobs[len(probe):] == alone.logprobs


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1.0, seed=7, logprobs=2, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_a_request_is_bitwise_batch_invariant_at_the_0_6b_shape(qwen3_0_6b, params) -> None:
    check(qwen3_0_6b, params)


def test_chunked_prefill_does_not_change_a_bit(qwen3_0_6b) -> None:
    check(qwen3_0_6b, SamplingParams(max_tokens=16, temperature=0.0, logprobs=0,
                                     ignore_eos=True), max_num_batched_tokens=96)


def test_moe_is_bitwise_batch_invariant(tmp_path) -> None:
    moe = write_tiny_checkpoint(tmp_path / "moe", kind="qwen3-moe")
    check(moe, SamplingParams(max_tokens=16, temperature=1.0, seed=3, logprobs=0,
                              ignore_eos=True))


def test_the_hybrid_model_is_refused(tmp_path) -> None:
    hybrid = write_tiny_checkpoint(tmp_path / "next", kind="qwen3-next")
    with pytest.raises(BackendError, match="batch_invariant"):
        LLM(str(hybrid), **ENGINE)


@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)],
                         ids=["qkv", "o", "gate_up", "down"])
def test_the_invariant_products_keep_a_rows_bits_at_every_row_count(n, k) -> None:
    """Decode-sized products run a program per K slice, long prefills one program
    walking the slices: a row's bits are the same either way, on the tensor cores."""
    from kvrunner.layers.fused.invariant_gemm_triton import (
        IN_PROGRAM_ROWS,
        invariant_gemm,
        invariant_launch,
    )

    g = torch.Generator(device="cuda").manual_seed(n + k)
    weight = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    rows = torch.randn(IN_PROGRAM_ROWS + 88, k, device="cuda", generator=g).to(torch.bfloat16)
    assert invariant_launch(len(rows), n, k).in_program
    whole = invariant_gemm(rows, weight)
    last = len(rows) - 1
    for lo, hi in ((0, 1), (5, 6), (0, 64), (100, 356), (last, last + 1)):
        assert torch.equal(invariant_gemm(rows[lo:hi], weight), whole[lo:hi]), (lo, hi)
    sliced = invariant_launch(1, n, k)
    assert torch.equal(invariant_gemm(rows, weight, sliced), whole)
