"""How two-batch overlap cuts a step: every token in exactly one part, a sequence
cut in two continues where its first part stopped, and each part's mirrors hold
exactly the parent step's rows for that part."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kvrunner_tbo import TwoBatchOverlap

from kvrunner.plugin_api import BackendError, StepMetadata, hookimpl
from kvrunner.plugin_host.backend_manager import BackendManager
from kvrunner.plugin_host.plugins import register_backend, unregister_backend
from kvrunner.runner.step.step_batch import prepare_step
from kvrunner.runner.step.step_metadata import StepMetadataBuilder
from kvrunner.sampling_params import SamplingParams
from kvrunner.testing.harness import backend_manager, small_model_spec
from kvrunner.testing.steps import Row, step_of

BLOCK, MAX_SEQS, MAX_TOKENS, MAX_LEN = 4, 8, 64, 64
HYBRID = small_model_spec(("full_attention", "linear_attention"))
SELECTION = {"full_attention": "paged", "linear_attention": "gdn"}
GREEDY = SamplingParams(temperature=0.0)


def _manager(overlap: str | None) -> tuple[BackendManager, StepMetadataBuilder]:
    manager = backend_manager(SELECTION, HYBRID, block_size=BLOCK, max_num_seqs=MAX_SEQS,
                              max_num_batched_tokens=MAX_TOKENS, max_model_len=MAX_LEN,
                              overlap=overlap)
    manager.persistent_buffers(max_batch=MAX_SEQS, max_tokens=MAX_TOKENS)
    builder = StepMetadataBuilder(max_batch=MAX_SEQS, max_tokens=MAX_TOKENS,
                                  max_blocks_per_seq=MAX_LEN // BLOCK, device=torch.device("cpu"))
    return manager, builder


@st.composite
def steps(draw) -> tuple[list[Row], int | None]:
    """Decode steps (maybe padded, as a graph replays them), prefill and mixed steps."""
    kind = draw(st.sampled_from(["decode", "prefill", "mixed"]))
    rows, budget = [], MAX_TOKENS
    for seq_id in range(draw(st.integers(1, MAX_SEQS))):
        decode = kind == "decode" or (kind == "mixed" and draw(st.booleans()))
        n = 1 if decode else draw(st.integers(1, min(12, budget - (MAX_SEQS - seq_id))))
        start = draw(st.integers(1 if decode else 0, 20))
        budget -= n
        blocks = tuple(draw(st.permutations(range(40)))[: -(-(start + n) // BLOCK)])
        rows.append(Row(seq_id, (1,) * n, start, blocks, seq_id, True, GREEDY, 0))
    padded = len(rows) + draw(st.integers(0, MAX_SEQS - len(rows))) if kind == "decode" else None
    return rows, padded


def _step(builder: StepMetadataBuilder, rows: list[Row], padded: int | None) -> StepMetadata:
    batch = prepare_step(step_of(rows), block_size=BLOCK, num_padded_seqs=padded).batch
    return builder.fill(batch)


@given(steps())
def test_the_parts_cover_every_token_row_once_and_continue_a_cut_sequence(case) -> None:
    rows, padded = case
    manager, builder = _manager("tbo")
    step = _step(builder, rows, padded)
    parts = manager.build_metadata(step).micro_batches
    if step.num_padded_seqs < 2 and step.num_tokens < 2:
        assert parts == ()  # one row cannot be split
        return
    assert len(parts) == 2
    assert parts[0].tokens.start == 0 and parts[0].tokens.stop == parts[1].tokens.start
    assert parts[1].tokens.stop == step.num_padded_tokens
    host = step.host
    for name in ("positions", "slot_mapping"):
        joined = torch.cat([getattr(p.step.host, name) for p in parts])
        assert torch.equal(joined, getattr(host, name)[: step.num_tokens]), name
    first, second = parts[0].step.host, parts[1].step.host
    if first.num_seqs and second.num_seqs and first.state_slots[-1] == second.state_slots[0]:
        # One sequence in both parts: the second continues where the first stopped.
        assert int(second.start_positions[0]) == int(first.context_lens[-1])
        assert int(first.start_positions[-1]) + int(first.query_lens[-1]) == int(
            second.start_positions[0])
    for part in parts:
        n = part.step.num_seqs
        assert torch.equal(part.step.context_lens[:n], part.step.host.context_lens[:n])
        assert torch.equal(part.step.query_start_loc[: n + 1], part.step.host.cu_query_lens)
        assert torch.equal(part.step.positions[: part.step.num_tokens], part.step.host.positions)


@given(steps())
def test_each_parts_mirrors_hold_exactly_its_rows_of_the_whole_steps_metadata(case) -> None:
    rows, padded = case
    manager, builder = _manager("tbo")
    plain, plain_builder = _manager(None)
    step = _step(builder, rows, padded)
    parts = manager.build_metadata(step).micro_batches
    whole = plain.build_metadata(_step(plain_builder, rows, padded))
    if not parts:
        return
    own = {t.buffer.untyped_storage().data_ptr() for t in manager.layer_write_targets()}
    slots = []
    for part in parts:
        paged = part.context.for_backend("paged")
        gdn = part.context.for_backend("gdn")
        for t in (paged.slot_mapping, gdn.write_indices):
            assert t.untyped_storage().data_ptr() not in own, "a part reads a backend's own buffer"
        slots.append(paged.slot_mapping[: part.step.num_tokens])
        assert paged.slot_mapping[part.step.num_tokens :].eq(-1).all()
        want = part.step.host.state_slots[: part.step.num_seqs].to(torch.int32)
        assert torch.equal(gdn.write_indices[: part.step.num_seqs], want)
        assert gdn.write_indices[part.step.num_seqs :].eq(-1).all()
    ours = torch.cat(slots)
    assert torch.equal(ours, whole.for_backend("paged").slot_mapping[: step.num_tokens])
    parts_again = manager.build_metadata(step).micro_batches
    mirrors = [p.context.for_backend("paged").slot_mapping for p in parts_again]
    assert mirrors[0].untyped_storage().data_ptr() != mirrors[1].untyped_storage().data_ptr()


def test_small_steps_are_not_split() -> None:
    manager = backend_manager(SELECTION, HYBRID, block_size=BLOCK, max_num_seqs=MAX_SEQS,
                              max_num_batched_tokens=MAX_TOKENS, max_model_len=MAX_LEN)
    assert manager.overlap is None
    manager, builder = _manager("tbo")
    one = [Row(0, (1,), 0, (0,), 0, True, GREEDY, 0)]
    assert manager.build_metadata(_step(builder, one, None)).micro_batches == ()


class LosesARow(TwoBatchOverlap):
    """Cuts like tbo, then drops the last token row from its second part."""

    @hookimpl
    def plan_micro_batches(self, step, layers):
        """tbo's parts, the second one short a row."""
        parts = super().plan_micro_batches(step, layers)
        if parts is None:
            return None
        last = parts[1]
        short = slice(last.tokens.start, last.tokens.stop - 1)
        return (parts[0], attrs.evolve(last, tokens=short))


def test_the_core_refuses_micro_batches_that_do_not_cover_every_row() -> None:
    """The core checks what plan_micro_batches returns before forward_micro_batches
    could run it (tbo's overlap_buffers made the mirrors it fills)."""
    register_backend("tbo-short", LosesARow)
    try:
        manager = backend_manager(SELECTION, HYBRID, block_size=BLOCK, max_num_seqs=MAX_SEQS,
                                  max_num_batched_tokens=MAX_TOKENS, max_model_len=MAX_LEN,
                                  overlap="tbo-short")
        manager.persistent_buffers(max_batch=MAX_SEQS, max_tokens=MAX_TOKENS)
        builder = StepMetadataBuilder(max_batch=MAX_SEQS, max_tokens=MAX_TOKENS,
                                      max_blocks_per_seq=MAX_LEN // BLOCK,
                                      device=torch.device("cpu"))
        rows = [Row(i, (1, 1, 1), 0, (i,), i, True, GREEDY, 0) for i in range(2)]
        with pytest.raises(BackendError, match="not 0..6 exactly once"):
            manager.build_metadata(_step(builder, rows, None))
    finally:
        unregister_backend("tbo-short")


def test_a_layer_backend_cannot_be_selected_as_the_overlap_plugin() -> None:
    with pytest.raises(BackendError, match="is a layer backend, not an overlap plugin"):
        backend_manager(SELECTION, HYBRID, overlap="paged")
