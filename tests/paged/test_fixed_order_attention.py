"""Deterministic mode's attention (``ops/paged_attention/fixed_order.py``): the naive
reference's values, with keys cut into splits of a fixed number of keys, in either layout.

Under the interpreter (``tl.dot`` is numpy's product, which may round a row by its
place in the tile) these show the values and that the two layouts of a decode step
agree bit for bit; test_fixed_order_attention_gpu.py shows on the GPU that a token
gets the same bits as a decode row, in a prompt and in a chunk.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from paged_cases import TRITON_DEVICE, PagedCase, assert_matches_reference, paged_cases

from kvrunner import LLM, SamplingParams
from kvrunner.plugin_api import PAD_SLOT_ID
from kvrunner_paged.ops.paged_attention.fixed_order import (
    KEY_SPLIT,
    LAUNCH,
    fixed_order_attention,
    use_split_programs,
)
from kvrunner_paged.ops.paged_attention.inputs import NewKV, PagedAttentionInputs
from kvrunner_paged.ops.paged_attention.naive import naive_paged_attention
from kvrunner_paged.ops.store_kv.naive import naive_store_kv

#: small tiles and splits, so the tiny cases cross several splits
SMALL = attrs.evolve(LAUNCH[torch.float32], block_m=16, block_n=16)
SPLIT = 16


def _inputs(case: PagedCase) -> dict[str, torch.Tensor]:
    gen = case.generator()
    pool = case.pool(gen, poison_unread=True)
    return {
        "q": torch.randn((case.num_tokens, case.num_heads, case.head_dim), generator=gen),
        "k_cache": pool[0],
        "v_cache": pool[1],
        "block_tables": case.block_table_tensor(case.num_seqs),
        "query_start_loc": case.query_start_loc(),
        "context_lens": case.context_lens_tensor(case.num_seqs),
    }


def _launch(case: PagedCase, inputs: PagedAttentionInputs, split_programs: bool) -> torch.Tensor:
    """The Triton launch at the small tiles and splits."""
    return fixed_order_attention(
        inputs=inputs, max_context_len=case.max_blocks_per_seq * case.block_size,
        split_programs=split_programs, key_split=SPLIT, launch=SMALL,
    )


def _attend(case: PagedCase, x: dict[str, torch.Tensor], split_programs: bool) -> torch.Tensor:
    inputs = PagedAttentionInputs(
        **{k: t.to(TRITON_DEVICE) for k, t in x.items()}, scale=case.scale,
        num_seqs=case.num_seqs, max_query_len=max(case.query_lens),
    )
    return _launch(case, inputs, split_programs).cpu()


def _case(context_lens: tuple[int, ...], query_lens: tuple[int, ...]) -> PagedCase:
    """Sequences of these contexts in a shuffled pool of 8-slot blocks, GQA 2."""
    blocks = [-(-c // 8) for c in context_lens]
    order = torch.randperm(sum(blocks), generator=torch.Generator().manual_seed(3)).tolist()
    tables = tuple(tuple(order[sum(blocks[:i]) : sum(blocks[: i + 1])])
                   for i in range(len(blocks)))
    return PagedCase(block_size=8, num_blocks=sum(blocks), num_heads=4, num_kv_heads=2,
                     head_dim=16, max_blocks_per_seq=max(blocks), query_lens=query_lens,
                     context_lens=context_lens, block_tables=tables, num_pad_rows=0, seed=5)


# Five splits of one long prompt, a chunk after a prefix crossing three, a short one.
@example(case=_case((77, 40, 9), (77, 30, 9)))
@given(case=paged_cases(max_query_len=40))
def test_prompts_and_chunks_match_the_reference(case: PagedCase) -> None:
    x = _inputs(case)
    ref = naive_paged_attention(**x, scale=case.scale)
    assert_matches_reference(_attend(case, x, split_programs=False), ref)


@example(case=_case((5, 16, 17, 40, 77), (1, 1, 1, 1, 1)))
@given(case=paged_cases(decode=True))
def test_a_decode_step_gets_the_same_bits_in_either_layout(case: PagedCase) -> None:
    """A program per split and a fold in split order, or one program walking the
    splits: the same values, bit for bit (the layout follows the step's shape)."""
    x = _inputs(case)
    walked = _attend(case, x, split_programs=False)
    split = _attend(case, x, split_programs=True)
    assert_matches_reference(split, naive_paged_attention(**x, scale=case.scale))
    assert torch.equal(split, walked)


def test_split_programs_serve_small_decode_steps_over_long_contexts() -> None:
    assert use_split_programs(1, num_seqs=4, num_kv_heads=8, max_context_len=4096, num_sms=132)
    # the unsplit grid already covers every SM, or contexts fit one split, or a prompt
    assert not use_split_programs(1, 17, 8, 4096, 132)
    assert not use_split_programs(1, 4, 8, KEY_SPLIT, 132)
    assert not use_split_programs(2, 4, 8, 4096, 132)


def test_split_programs_refuse_prompt_rows() -> None:
    case = _case((20,), (20,))
    with pytest.raises(AssertionError, match="decode rows only"):
        _attend(case, _inputs(case), split_programs=True)


def _with_new_kv(case: PagedCase) -> dict[str, torch.Tensor]:
    """Decode inputs plus this step's keys and values, not yet in the pool (it holds NaN
    at each row's newest slot: a kernel that attended before storing would output NaN)."""
    x = _inputs(case)
    gen = case.generator()
    kv = torch.randn((case.num_seqs, 2 * case.num_kv_heads + 1, case.head_dim), generator=gen)
    x["k_new"], x["v_new"] = kv[:, : case.num_kv_heads], kv[:, case.num_kv_heads : -1]
    x["slots"] = case.slot_mapping()[: case.num_seqs]
    for slot in x["slots"].tolist():
        block, offset = divmod(slot, case.block_size)
        x["k_cache"][block, offset] = float("nan")
        x["v_cache"][block, offset] = float("nan")
    return x


def _fused(case: PagedCase, x: dict[str, torch.Tensor], split_programs: bool):
    """The launch that stores as it attends: (output, k pool after, v pool after)."""
    on = {k: t.to(TRITON_DEVICE) for k, t in x.items()}
    inputs = PagedAttentionInputs(
        q=on["q"], k_cache=on["k_cache"], v_cache=on["v_cache"], block_tables=on["block_tables"],
        query_start_loc=on["query_start_loc"], context_lens=on["context_lens"], scale=case.scale,
        num_seqs=case.num_seqs, max_query_len=1,
        new_kv=NewKV(k=on["k_new"], v=on["v_new"], slot_mapping=on["slots"]),
    )  # fmt: skip
    out = _launch(case, inputs, split_programs)
    return out.cpu(), on["k_cache"].cpu(), on["v_cache"].cpu()


@example(case=_case((5, 16, 17, 40, 77), (1, 1, 1, 1, 1)), split_programs=True)
@given(case=paged_cases(decode=True, max_pad_rows=0), split_programs=st.booleans())
def test_a_decode_step_that_stores_as_it_attends_equals_store_then_attend(
    case: PagedCase, split_programs: bool
) -> None:
    """``new_kv``: the pool after the launch is the store's, bit for bit, and the output
    is the bits of the same launch over the stored pool, in either layout."""
    x = _with_new_kv(case)
    out, k_after, v_after = _fused(case, x, split_programs)
    stored = {**x, "k_cache": x["k_cache"].clone(), "v_cache": x["v_cache"].clone()}
    naive_store_kv(x["k_new"], x["v_new"], stored["k_cache"], stored["v_cache"], x["slots"])
    assert torch.equal(k_after.view(torch.int32), stored["k_cache"].view(torch.int32))
    assert torch.equal(v_after.view(torch.int32), stored["v_cache"].view(torch.int32))
    apart = {k: stored[k] for k in _inputs(case)}
    assert torch.equal(out, _attend(case, apart, split_programs=split_programs))


@given(case=paged_cases(decode=True, max_pad_rows=0), split_programs=st.booleans())
def test_a_decode_step_over_an_all_pad_slot_mapping_stores_nothing(
    case: PagedCase, split_programs: bool
) -> None:
    """What a capture does to the launch: slots blanked to PAD, contexts as they were."""
    x = _with_new_kv(case)
    x["slots"] = torch.full_like(x["slots"], PAD_SLOT_ID)
    _, k_after, v_after = _fused(case, x, split_programs)
    assert torch.equal(k_after.view(torch.int32), x["k_cache"].view(torch.int32))
    assert torch.equal(v_after.view(torch.int32), x["v_cache"].view(torch.int32))


def test_an_engine_on_the_triton_path_computes_what_the_torch_path_does() -> None:
    """Deterministic mode through a whole engine with ``[kernels] triton_on_cpu`` (the
    layer storing as it attends in decode, a prompt chunked in steps of 16 tokens,
    prompt logprobs) against the same engine on the torch path."""
    settings = dict(deterministic=True, device="cpu", max_num_seqs=4, max_model_len=96,
                    block_size=8, num_blocks=64, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, prompt_logprobs=0,
                            ignore_eos=True)
    prompts = [list(range(3, 40)), [5, 6, 7]]
    with LLM("tiny-qwen3", triton_on_cpu=True, **settings) as triton_llm:
        on_triton = triton_llm.generate(prompts, params)
    with LLM("tiny-qwen3", **settings) as torch_llm:
        on_torch = torch_llm.generate(prompts, params)
    for got, want in zip(on_triton, on_torch, strict=True):
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs),
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(got.prompt_logprobs[1:]),
                                   torch.tensor(want.prompt_logprobs[1:]), atol=1e-5, rtol=0)
