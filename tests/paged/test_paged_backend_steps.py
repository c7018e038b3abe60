"""Whole steps through the hooks: metadata, layer forward, capture and replay.

Every test drives a real ``BackendManager`` with the ``paged`` backend selected for
``full_attention`` layers (layer 1 of the tiny model is a linear layer it must not
serve), on both kernel paths, and checks against the naive reference.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from paged_cases import TRITON_DEVICE, PagedCase, assert_matches_reference, paged_cases

from kvrunner.contract import PAD_SLOT_ID, ModelSpec
from kvrunner.plugins import BackendManager
from kvrunner.testing.harness import backend_manager
from kvrunner_paged.kernels.reference import reference_paged_attention, reference_store_kv

FULL = "full_attention"
LAYER_TYPES = (FULL, "linear_attention", FULL)
SERVED = (0, 2)
MAX_BATCH, MAX_TOKENS, MAX_MODEL_LEN = 8, 64, 64
use_triton = pytest.mark.parametrize("triton", [False, True], ids=["torch", "triton"])


def _setup(case: PagedCase, triton: bool) -> tuple[BackendManager, dict[str, torch.Tensor]]:
    """Manager, pools filled with random data (NaN outside every context), buffers."""
    spec = ModelSpec(
        num_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES, num_heads=case.num_heads,
        num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
    )
    mgr = backend_manager(
        {FULL: "paged"}, spec, block_size=case.block_size, max_num_seqs=MAX_BATCH,
        max_num_batched_tokens=MAX_TOKENS, max_model_len=MAX_MODEL_LEN, use_triton=triton,
        device=str(TRITON_DEVICE if triton else "cpu"),
    )
    pools = mgr.allocate_cache(num_blocks=case.num_blocks, num_slots=MAX_BATCH + 1)
    gen = case.generator()
    for pool in pools.values():
        pool.copy_(case.pool(gen, poison_unread=True))
    _leave_stale_rows(mgr.persistent_buffers(max_batch=MAX_BATCH, max_tokens=MAX_TOKENS), case)
    return mgr, pools


def _leave_stale_rows(buffers: dict[str, torch.Tensor], case: PagedCase) -> None:
    """Fill every buffer as a bigger earlier step might have: valid slots, lengths, blocks.

    If a fill leaves any row of these behind, a padded row would write a live slot or
    read a live sequence, and the pool or output comparisons catch it.
    """
    gen = torch.Generator().manual_seed(case.seed + 2)
    num_slots = case.num_blocks * case.block_size
    for name, high in [("slot_mapping", num_slots), ("block_tables", case.num_blocks),
                       ("context_lens", case.block_size + 1), ("query_start_loc", 3)]:
        buffer = buffers[f"paged.{name}"]
        buffer.copy_(torch.randint(0, high, buffer.shape, generator=gen))  # any device


def _run_layers(
    case: PagedCase, mgr: BackendManager, pools: dict[str, torch.Tensor], ctx, rows: int
) -> None:
    """Forward every served layer over ``rows`` token rows; check pool and output."""
    gen = torch.Generator().manual_seed(case.seed + 1)
    slots = case.slot_mapping()[:rows]  # real slots, then PAD for the padded tail
    seq_rows = case.num_seqs + (rows - case.num_tokens)
    if case.is_decode:  # one query per row, padded rows included (context length 0)
        starts = torch.arange(seq_rows + 1, dtype=torch.int32)
    else:
        starts = case.query_start_loc()
    for layer_index in SERVED:
        q = torch.randn((rows, case.num_heads, case.head_dim), generator=gen)
        k = torch.randn((rows, case.num_kv_heads, case.head_dim), generator=gen)
        v = torch.randn((rows, case.num_kv_heads, case.head_dim), generator=gen)
        pool = pools[f"paged.kv.{layer_index}"]
        expected = pool.cpu().clone()
        reference_store_kv(k, v, expected[0], expected[1], slots)

        layer = mgr.make_layer(layer_index=layer_index, layer_type=FULL)
        on = pool.device
        out = layer.forward(q.to(on), k.to(on), v.to(on), ctx).cpu()

        # Bitwise, NaN poison included: only the real slots changed.
        assert torch.equal(pool.cpu().view(torch.int32), expected.view(torch.int32))
        ref = reference_paged_attention(
            q, expected[0], expected[1], case.block_table_tensor(seq_rows), starts,
            case.context_lens_tensor(seq_rows), case.scale,
        )
        assert_matches_reference(out, ref)


@use_triton
@given(case=paged_cases())
def test_a_step_through_the_hooks_matches_the_reference(triton: bool, case: PagedCase) -> None:
    mgr, pools = _setup(case, triton)
    ctx = mgr.build_metadata(case.step_batch())
    rows = case.num_tokens + (case.num_pad_rows if case.is_decode else 0)
    _run_layers(case, mgr, pools, ctx, rows)


@given(case=paged_cases(decode=True))
def test_build_metadata_fills_the_registered_buffers_in_place(case: PagedCase) -> None:
    mgr, _ = _setup(case, triton=False)
    buffers = mgr.persistent_buffers(max_batch=MAX_BATCH, max_tokens=MAX_TOKENS)
    before = {k: v.data_ptr() for k, v in buffers.items()}
    md = mgr.build_metadata(case.step_batch()).for_backend("paged")
    assert {k: v.data_ptr() for k, v in buffers.items()} == before
    assert md.slot_mapping.data_ptr() == buffers["paged.slot_mapping"].data_ptr()
    assert md.context_lens.data_ptr() == buffers["paged.context_lens"].data_ptr()

    n, tokens = case.num_seqs, case.num_tokens
    sm = buffers["paged.slot_mapping"]
    assert sm[:tokens].tolist() == case.slot_mapping()[:tokens].tolist()
    assert sm[tokens:].eq(PAD_SLOT_ID).all()  # every row past the real ones writes nothing
    assert buffers["paged.context_lens"][n:].eq(0).all()  # and reads nothing
    assert buffers["paged.query_start_loc"][n:].eq(tokens).all()
    assert (md.num_seqs, md.num_tokens, md.is_decode) == (n, tokens, True)
    assert md.num_padded_seqs == n + case.num_pad_rows == md.context_lens.shape[0]


@given(case=paged_cases(decode=True))
def test_build_capture_metadata_leaves_slot_mapping_alone(case: PagedCase) -> None:
    mgr, _ = _setup(case, triton=False)
    buffers = mgr.persistent_buffers(max_batch=MAX_BATCH, max_tokens=MAX_TOKENS)
    mgr.build_metadata(case.step_batch())  # leave a real step's rows behind
    sm = buffers["paged.slot_mapping"]
    sm.copy_(torch.randint(-5, 1000, sm.shape, generator=case.generator()))
    snapshot = sm.clone()
    batch_size = case.num_seqs + case.num_pad_rows
    md = mgr.build_capture_metadata(batch_size).for_backend("paged")
    assert torch.equal(sm, snapshot)  # blanking is the core's job, not the backend's
    assert md.context_lens.eq(1).all() and md.block_tables.eq(0).all()  # in-bounds read side
    assert md.is_decode and md.slot_mapping.shape == (batch_size,)


@use_triton
@given(case=paged_cases(decode=True))
def test_capture_over_a_blanked_slot_mapping_writes_no_cache(triton: bool, case: PagedCase) -> None:
    mgr, pools = _setup(case, triton)
    mgr.build_metadata(case.step_batch())  # a live batch's slots sit in the buffer
    for target in mgr.cache_write_targets():  # what the core does before each capture
        target.buffer.fill_(target.pad_value)
    batch_size = case.num_seqs + case.num_pad_rows
    ctx = mgr.build_capture_metadata(batch_size)
    snapshot = {k: v.clone() for k, v in pools.items()}
    gen = case.generator()
    for layer_index in SERVED:
        on = pools[f"paged.kv.{layer_index}"].device
        q = torch.randn((batch_size, case.num_heads, case.head_dim), generator=gen).to(on)
        kv = torch.randn((batch_size, case.num_kv_heads, case.head_dim), generator=gen).to(on)
        layer = mgr.make_layer(layer_index=layer_index, layer_type=FULL)
        out = layer.forward(q, kv, kv, ctx)
        assert out.shape == q.shape
    for name, pool in pools.items():
        assert torch.equal(pool.view(torch.int32), snapshot[name].view(torch.int32)), name


@use_triton
@given(case=paged_cases(decode=True))
def test_replay_with_capture_metadata_sees_the_step_filled_later(
    triton: bool, case: PagedCase
) -> None:
    """A graph keeps the capture-time metadata; in-place fills must reach it.

    Capture at the padded size, then fill a real decode step padded to that size and
    run the forward with the *capture-time* context, as a replayed graph does: real
    rows match the reference, padded rows write nothing and come out as zeros.
    """
    mgr, pools = _setup(case, triton)
    for target in mgr.cache_write_targets():
        target.buffer.fill_(target.pad_value)
    batch_size = case.num_seqs + case.num_pad_rows
    capture_ctx = mgr.build_capture_metadata(batch_size)
    mgr.build_metadata(case.step_batch())
    _run_layers(case, mgr, pools, capture_ctx, batch_size)
