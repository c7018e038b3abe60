"""Hypothesis strategies for valid steps, independent of any pool layout.

A :class:`StepCase` is a short serving history ending in the step under test:

1. *retired* sequences are served whole and finish, leaving their KV blocks and
   state slots full of real data, which the live sequences then reuse;
2. each *live* sequence's prefix is served, in one or two chunks (chunked prefill);
3. the final step gives every live sequence its query: a decode (one token each,
   optionally padded with PAD rows as a replayed graph would be), a prefill, or a
   mix of both.

Block tables are drawn from a shuffled pool, slots from a shuffled slot list;
nothing assumes how a backend lays its cache out.
"""

from __future__ import annotations

import attrs
from hypothesis import strategies as st

#: the kit's engine shape: small enough for the Triton interpreter
BLOCK_SIZE = 4
NUM_BLOCKS = 32
MAX_SEQS = 6  # also the largest (padded) decode batch
NUM_SLOTS = MAX_SEQS + 1  # the last slot is the scratch slot no request owns
MAX_TOKENS = 64
MAX_MODEL_LEN = 64


@attrs.frozen
class Seq:
    """One sequence: ``length`` tokens by the end of the case, in ``blocks``, state in ``slot``."""

    uid: int
    length: int
    blocks: tuple[int, ...]
    slot: int
    #: end of its first prefix chunk, end of its prefix (== start of the final query)
    cuts: tuple[int, int]


@attrs.frozen
class StepCase:
    retired: tuple[Seq, ...]
    live: tuple[Seq, ...]
    num_pad_rows: int
    seed: int

    @property
    def final_is_decode(self) -> bool:
        return all(s.length - s.cuts[1] == 1 and s.cuts[1] > 0 for s in self.live)

    def history(self) -> list[list[tuple[Seq, int, int]]]:
        """The steps before the final one, each a list of ``(seq, start, end)``."""
        steps = [
            [(s, 0, s.length) for s in self.retired],
            [(s, 0, s.cuts[0]) for s in self.live if s.cuts[0] > 0],
            [(s, s.cuts[0], s.cuts[1]) for s in self.live if s.cuts[1] > s.cuts[0]],
        ]
        return [step for step in steps if step]

    def final(self) -> list[tuple[Seq, int, int]]:
        return [(s, s.cuts[1], s.length) for s in self.live]


@st.composite
def _seq(draw: st.DrawFn, uid: int, blocks: list[int], slot: int, decode: bool | None) -> Seq:
    query = 1 if decode else draw(st.integers(1, 6))
    prefix = draw(st.integers(1 if decode else 0, 14))
    if decode is None and draw(st.booleans()):
        query = 1
    first_chunk = draw(st.integers(0, prefix)) if prefix else 0
    length = prefix + query
    need = -(-length // BLOCK_SIZE)
    return Seq(uid, length, tuple(blocks[:need]), slot, (first_chunk, prefix))


@st.composite
def step_cases(
    draw: st.DrawFn,
    *,
    decode: bool | None = None,
    max_seqs: int = 4,
    max_pad_rows: int = MAX_SEQS - 4,
    max_retired: int = 2,
) -> StepCase:
    """A case whose final step is a decode (``decode=True``), has at least one longer
    query (``False``), or either (``None``). PAD rows only pad a decode."""
    retired_blocks = list(draw(st.permutations(range(NUM_BLOCKS))))
    retired_slots = list(draw(st.permutations(range(NUM_SLOTS - 1))))
    retired = []
    for uid in range(draw(st.integers(0, max_retired))):
        length = draw(st.integers(1, 8))
        need = -(-length // BLOCK_SIZE)
        blocks, retired_blocks = retired_blocks[:need], retired_blocks[need:]
        retired.append(Seq(100 + uid, length, tuple(blocks), retired_slots[uid], (0, 0)))
    free = list(draw(st.permutations(range(NUM_BLOCKS))))
    slots = draw(st.permutations(range(NUM_SLOTS - 1)))
    live = []
    for uid in range(draw(st.integers(1, max_seqs))):
        seq = draw(_seq(uid, free, slots[uid], decode))
        free = free[len(seq.blocks) :]
        live.append(seq)
    if decode is False and all(s.length - s.cuts[1] == 1 for s in live):
        first = live[0]
        live[0] = attrs.evolve(first, length=first.length + 1)
        need = -(-live[0].length // BLOCK_SIZE)
        if need > len(first.blocks):
            live[0] = attrs.evolve(live[0], blocks=(*first.blocks, free[0]))
    case = StepCase(tuple(retired), tuple(live), 0, draw(st.integers(0, 2**31 - 1)))
    if case.final_is_decode:
        case = attrs.evolve(case, num_pad_rows=draw(st.integers(0, max_pad_rows)))
    return case
