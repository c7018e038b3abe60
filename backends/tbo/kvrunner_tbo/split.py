"""Where a step is cut, and each part as a step of its own.

Decode steps (and decode graphs) are cut at the sequence midpoint of their padded
rows, so a graph captured for a batch size and every step replayed on it are cut
alike. Prefill and mixed steps are cut at the token midpoint: the sequence holding
that token is cut in two, its first tokens in part 0 and the rest in part 1, which
then attends to (and continues the state of) what part 0 wrote in the same layer.
"""

from __future__ import annotations

import attrs
import torch

from kvrunner.plugin_api import StepBatch, StepMetadata


@attrs.frozen
class Cut:
    """Part 1 starts in sequence ``seq``, after its first ``tokens_before`` tokens
    (0: the cut falls between sequences ``seq - 1`` and ``seq``)."""

    seq: int
    tokens_before: int = 0


def choose_cut(step: StepMetadata, *, min_tokens: int, min_decode_seqs: int) -> Cut | None:
    """The cut for ``step``, or ``None`` when it is too small for the split to pay."""
    if step.is_decode:
        rows = step.num_padded_seqs
        return Cut(rows // 2) if rows >= max(min_decode_seqs, 2) else None
    if step.num_padded_seqs != step.num_seqs or step.num_tokens < max(min_tokens, 2):
        return None  # padded rows only come with decode graphs
    middle = step.num_tokens // 2
    cu = step.host.cu_query_lens[: step.num_seqs + 1]
    seq = int(torch.searchsorted(cu, torch.tensor(middle, dtype=cu.dtype), right=True)) - 1
    return Cut(seq, middle - int(cu[seq]))


class PartBuffers:
    """The read side a part cannot share with its parent step, in persistent buffers:
    each part's rebased sequence offsets, and part 0's context lengths (its last
    sequence may be cut short)."""

    def __init__(self, *, max_batch: int, device: torch.device) -> None:
        i32 = {"dtype": torch.int32, "device": device}
        self.query_start_loc = [torch.zeros((max_batch + 1,), **i32) for _ in range(2)]
        self.first_context_lens = torch.zeros((max_batch,), **i32)

    def buffers(self) -> dict[str, torch.Tensor]:
        return {
            "part0.query_start_loc": self.query_start_loc[0],
            "part1.query_start_loc": self.query_start_loc[1],
            "part0.context_lens": self.first_context_lens,
        }

    def split(self, step: StepMetadata, cut: Cut) -> tuple[StepMetadata, StepMetadata]:
        """The two parts of ``step``; every tensor a view of a persistent buffer."""
        if cut.tokens_before == 0:
            parts = (step.micro_batch(0, cut.seq), step.micro_batch(cut.seq, step.num_padded_seqs))
        else:
            parts = _cut_inside(step, cut, self.first_context_lens)
        return tuple(  # type: ignore[return-value]
            attrs.evolve(part, query_start_loc=_place(buffer, part.query_start_loc))
            for part, buffer in zip(parts, self.query_start_loc, strict=True)
        )


def _place(buffer: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    view = buffer[: values.shape[0]]
    view.copy_(values, non_blocking=True)
    return view


def _cut_inside(
    step: StepMetadata, cut: Cut, first_context_lens: torch.Tensor
) -> tuple[StepMetadata, StepMetadata]:
    """Parts of an unpadded step whose sequence ``cut.seq`` is cut in two."""
    host, s, a = step.host, cut.seq, cut.tokens_before
    n, cu = step.num_seqs, host.cu_query_lens
    t = int(cu[s]) + a  # first token row of part 1
    one = lambda v: torch.tensor([v], dtype=torch.int32)  # noqa: E731
    start_s = int(host.start_positions[s])
    first = StepBatch(
        num_seqs=s + 1, num_tokens=t, num_padded_seqs=s + 1,
        query_lens=torch.cat([host.query_lens[:s], one(a)]),
        start_positions=host.start_positions[: s + 1],
        context_lens=torch.cat([host.context_lens[:s], one(start_s + a)]),
        cu_query_lens=torch.cat([cu[: s + 1], one(t)]),
        block_table_array=host.block_table_array[: s + 1],
        slot_mapping=host.slot_mapping[:t], state_slots=host.state_slots[: s + 1],
        positions=host.positions[:t],
    )  # fmt: skip
    second = StepBatch(
        num_seqs=n - s, num_tokens=step.num_tokens - t, num_padded_seqs=n - s,
        query_lens=torch.cat([one(int(host.query_lens[s]) - a), host.query_lens[s + 1 : n]]),
        start_positions=torch.cat([one(start_s + a), host.start_positions[s + 1 : n]]),
        context_lens=host.context_lens[s:n],
        cu_query_lens=torch.cat([one(0), cu[s + 1 : n + 1] - t]),
        block_table_array=host.block_table_array[s:n],
        slot_mapping=host.slot_mapping[t : step.num_tokens], state_slots=host.state_slots[s:n],
        positions=host.positions[t : step.num_tokens],
    )  # fmt: skip
    context_lens = first_context_lens[: s + 1]
    context_lens.copy_(first.context_lens, non_blocking=True)
    return (
        _part(step, first, slice(0, t), slice(0, s + 1), context_lens),
        _part(step, second, slice(t, step.num_tokens), slice(s, n), step.context_lens[s:n]),
    )


def _part(
    step: StepMetadata, host: StepBatch, tokens: slice, seqs: slice, context_lens: torch.Tensor
) -> StepMetadata:
    return StepMetadata(
        host=host,
        query_start_loc=host.cu_query_lens,  # placed in the part's buffer by the caller
        context_lens=context_lens,
        block_tables=step.block_tables[seqs],
        positions=step.positions[tokens],
        num_seqs=host.num_seqs, num_padded_seqs=host.num_seqs,
        num_tokens=host.num_tokens, num_padded_tokens=host.num_tokens,
        max_query_len=int(host.query_lens.max()), max_context_len=int(host.context_lens.max()),
        is_decode=host.is_decode, is_capture=step.is_capture,
    )  # fmt: skip
