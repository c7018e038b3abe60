"""The paged-attention inputs record refuses what no entry can attend, before any launch."""

from __future__ import annotations

import attrs
import pytest
import torch

from kvrunner_paged.ops.paged_attention.decode_torch import paged_decode_attention_torch
from kvrunner_paged.ops.paged_attention.inputs import NewKV, PagedAttentionInputs
from kvrunner_paged.ops.paged_attention.prefill_torch import paged_prefill_attention_torch


def _inputs(rows: int = 3, seqs: int = 3, **changes: object) -> PagedAttentionInputs:
    """``rows`` queries of 4 heads over 2 KV heads, metadata for ``seqs`` sequences."""
    cache = torch.zeros((4, 4, 2, 16))
    inputs = PagedAttentionInputs(
        q=torch.zeros((rows, 4, 16)), k_cache=cache, v_cache=cache.clone(),
        block_tables=torch.zeros((seqs, 2), dtype=torch.int32),
        context_lens=torch.ones(seqs, dtype=torch.int32),
        query_start_loc=torch.arange(seqs + 1, dtype=torch.int32), scale=0.25, num_seqs=seqs,
    )
    return attrs.evolve(inputs, **changes)


def test_a_well_formed_step_counts_its_sequences() -> None:
    assert _inputs().sequences(varlen=False) == 3
    assert _inputs(rows=5, seqs=2).sequences(varlen=True) == 2
    assert list(_inputs(seqs=2).sequence_rows()) == [(0, 0, 1, 1), (1, 1, 2, 1)]


@pytest.mark.parametrize(("inputs", "varlen", "message"), [
    (_inputs(rows=4), False, "4 sequences but block tables for 3"),
    (_inputs(q=torch.zeros((3, 3, 16))), False, "multiple of num_kv_heads"),
    (_inputs(query_start_loc=None), True, "needs query_start_loc and num_seqs"),
    (_inputs(query_start_loc=torch.arange(3, dtype=torch.int32)), True, "query_start_loc"),
])
def test_shapes_no_entry_can_attend_are_refused(inputs: PagedAttentionInputs, varlen: bool,
                                                message: str) -> None:
    with pytest.raises(ValueError, match=message):
        inputs.sequences(varlen=varlen)


def test_a_triton_varlen_entry_needs_the_longest_query_run() -> None:
    with pytest.raises(ValueError, match="max_query_len"):
        _inputs().sequences(varlen=True, triton=True)
    assert attrs.evolve(_inputs(), max_query_len=1).sequences(varlen=True, triton=True) == 3


def test_only_an_entry_that_stores_takes_new_kv() -> None:
    """Keys handed to an entry that stores nothing would never reach the pool it reads."""
    kv = torch.zeros((3, 2, 16))
    inputs = _inputs(new_kv=NewKV(k=kv, v=kv.clone(), slot_mapping=torch.arange(3)))
    assert inputs.sequences(varlen=False, triton=True, stores=True) == 3
    for entry in (paged_decode_attention_torch, paged_prefill_attention_torch):
        with pytest.raises(ValueError, match="stores nothing"):
            entry(inputs=inputs)
    short = attrs.evolve(inputs, new_kv=NewKV(k=kv[:2], v=kv[:2], slot_mapping=torch.arange(3)))
    with pytest.raises(ValueError, match="new_kv"):
        short.sequences(varlen=False, stores=True)
