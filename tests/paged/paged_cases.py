"""Random paged-attention batches for the paged backend's property tests.

A case is a handful of sequences (1-4), each with a cached prefix and some new
tokens, whose blocks are drawn from a shuffled free list of a small pool, plus an
optional padded tail of rows that must write and read nothing. Shapes stay tiny so
the Triton interpreter keeps up.
"""

from __future__ import annotations

import attrs
import torch
from hypothesis import strategies as st

from kvrunner.plugin_api import PAD_SLOT_ID, StepBatch
from kvrunner.plugin_api.step_data import pad_block_tables

HEAD_SHAPES = [(2, 1), (2, 2), (4, 1), (4, 2)]  # (query heads, kv heads)
#: where Triton kernels run: compiled on a GPU, interpreted (TRITON_INTERPRET=1) on the CPU
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@attrs.frozen(kw_only=True)
class PagedCase:
    block_size: int
    num_blocks: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_blocks_per_seq: int
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    num_pad_rows: int  # padded sequence rows (decode) / padded token rows after the real ones
    seed: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    def positions(self, seq: int) -> range:
        """Positions of sequence ``seq``'s new tokens."""
        return range(self.context_lens[seq] - self.query_lens[seq], self.context_lens[seq])

    def slot(self, seq: int, pos: int) -> int:
        table = self.block_tables[seq]
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def slot_mapping(self) -> torch.Tensor:
        """int64 ``[num_tokens + num_pad_rows]``: real slots, then a PAD tail."""
        real = [self.slot(i, p) for i in range(self.num_seqs) for p in self.positions(i)]
        return torch.tensor(real + [PAD_SLOT_ID] * self.num_pad_rows, dtype=torch.int64)

    def context_slots(self) -> set[int]:
        """Every slot some sequence may attend to (its whole context)."""
        return {
            self.slot(i, p) for i in range(self.num_seqs) for p in range(self.context_lens[i])
        }

    def block_table_tensor(self, rows: int) -> torch.Tensor:
        """int32 ``[rows, max_blocks_per_seq]``, zero past each table and on padded rows."""
        out = torch.zeros((rows, self.max_blocks_per_seq), dtype=torch.int32)
        for i, table in enumerate(self.block_tables):
            out[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        return out

    def context_lens_tensor(self, rows: int) -> torch.Tensor:
        out = torch.zeros((rows,), dtype=torch.int32)
        out[: self.num_seqs] = torch.tensor(self.context_lens, dtype=torch.int32)
        return out

    def query_start_loc(self) -> torch.Tensor:
        lens = torch.tensor((0, *self.query_lens), dtype=torch.int32)
        return torch.cumsum(lens, 0, dtype=torch.int32)

    def step_batch(self) -> StepBatch:
        """The batch as the core hands it to ``build_metadata`` (PAD rows not included)."""
        query = torch.tensor(self.query_lens, dtype=torch.int32)
        context = torch.tensor(self.context_lens, dtype=torch.int32)
        padded = self.num_seqs + (self.num_pad_rows if self.is_decode else 0)
        return StepBatch(
            num_seqs=self.num_seqs,
            num_tokens=self.num_tokens,
            num_padded_seqs=padded,
            query_lens=query,
            start_positions=context - query,
            context_lens=context,
            cu_query_lens=self.query_start_loc(),
            block_table_array=pad_block_tables(self.block_tables),
            slot_mapping=self.slot_mapping()[: self.num_tokens],
            state_slots=torch.arange(self.num_seqs, dtype=torch.int32),
            positions=torch.tensor(
                [p for i in range(self.num_seqs) for p in self.positions(i)], dtype=torch.int64
            ),
        )

    def generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed)

    def pool(self, gen: torch.Generator, *, poison_unread: bool) -> torch.Tensor:
        """``[2, num_blocks, block_size, kv_heads, dim]`` of random values.

        With ``poison_unread``, every slot outside all sequences' contexts holds NaN: an
        attention kernel that reads past a context (or a padded row that reads at all)
        then produces NaN instead of a plausible wrong number.
        """
        shape = (2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        pool = torch.randn(shape, generator=gen)
        if poison_unread:
            flat = pool.view(2, -1, self.num_kv_heads, self.head_dim)
            unread = torch.ones(flat.shape[1], dtype=torch.bool)
            unread[sorted(self.context_slots())] = False
            flat[:, unread] = float("nan")
        return pool


@st.composite
def paged_cases(
    draw: st.DrawFn,
    *,
    decode: bool = False,
    max_seqs: int = 4,
    max_pad_rows: int = 3,
    head_shapes: tuple[tuple[int, int], ...] = tuple(HEAD_SHAPES),
    head_dims: tuple[int, ...] = (16, 32),
    max_query_len: int = 12,
) -> PagedCase:
    """A batch of 1-``max_seqs`` sequences; ``decode`` gives every sequence one new token.

    ``max_query_len`` bounds each sequence's new tokens (prefill cases only).
    """
    block_size = draw(st.sampled_from([4, 8]))
    num_heads, num_kv_heads = draw(st.sampled_from(head_shapes))
    head_dim = draw(st.sampled_from(head_dims))
    num_blocks = draw(st.integers(6, 16))
    free = draw(st.permutations(range(num_blocks)))
    num_seqs = draw(st.integers(1, max_seqs))
    query_lens, context_lens, tables = [], [], []
    used = 0
    for _ in range(num_seqs):
        room = (num_blocks - used) * block_size
        if room == 0:
            break
        q_len = 1 if decode else draw(st.integers(1, min(room, max_query_len)))
        prefix = draw(st.integers(0, min(room - q_len, 20)))
        ctx = prefix + q_len
        blocks = -(-ctx // block_size)
        tables.append(tuple(free[used : used + blocks]))
        used += blocks
        query_lens.append(q_len)
        context_lens.append(ctx)
    # Wider than needed, like a table sized for max_model_len.
    max_blocks = max(len(t) for t in tables) + draw(st.integers(0, 2))
    return PagedCase(
        block_size=block_size,
        num_blocks=num_blocks,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_blocks_per_seq=max_blocks,
        query_lens=tuple(query_lens),
        context_lens=tuple(context_lens),
        block_tables=tuple(tables),
        num_pad_rows=draw(st.integers(0, max_pad_rows)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def assert_matches_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32 kernels against the fp32 naive reference: relative 1e-4, absolute 1e-5."""
    assert torch.isfinite(out).all(), "non-finite output (read outside a context?)"
    torch.testing.assert_close(out.float(), ref, rtol=1e-4, atol=1e-5)
