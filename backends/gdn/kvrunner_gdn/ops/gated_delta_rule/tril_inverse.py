"""``(I + A)^-1`` for a strictly lower-triangular ``A`` tile, inside a Triton program.

The UT transform of the chunked prefill needs this inverse once per chunk and head.
A serial row-by-row substitution over a whole 64-row tile is slow (each step is a
masked reduction over the tile), so the tile is split into 16 x 16 blocks: diagonal
blocks by substitution, the rest by block forward substitution with small matrix
products. Tested through the chunked prefill (chunks of 16 and 64) against the
token-by-token oracle.
"""

import triton
import triton.language as tl


@triton.jit
def invert_block(blk, SUB: tl.constexpr):
    """(I + blk)^-1 for a strictly lower ``[SUB, SUB]`` tile, by forward substitution:
    row i = e_i - sum_j blk[i, j] row_j. SUB is small, so the serial loop is cheap."""
    ss = tl.arange(0, SUB)
    inv = tl.where(ss[:, None] == ss[None, :], 1.0, 0.0)
    for i in range(1, SUB):
        b_i = tl.sum(tl.where(ss[:, None] == i, blk, 0.0), axis=0)
        r = tl.sum(b_i[:, None] * inv, axis=0)
        inv = tl.where(ss[:, None] == i, inv - r[None, :], inv)
    return inv


@triton.jit
def unit_lower_inverse(a, a_tile, t_tile, CHUNK: tl.constexpr, SUB: tl.constexpr):
    """T = (I + A)^-1 for strictly lower ``a [CHUNK, CHUNK]``, blockwise in SUB x SUB tiles.

    Diagonal tiles by substitution; below them, block forward substitution
    ``T[b, c] = -T[b, b] @ sum_{c <= d < b} A[b, d] @ T[d, c]``, a few small matrix
    products. Tiles go through this program's scratch (registers cannot be sliced);
    the barriers make one warp's stores visible to the others before they load.
    """
    NB: tl.constexpr = CHUNK // SUB
    tt = tl.arange(0, CHUNK)
    ss = tl.arange(0, SUB)
    tl.store(a_tile + tt[:, None] * CHUNK + tt[None, :], a)
    tl.debug_barrier()
    for b in tl.static_range(NB):
        at = (b * SUB + ss)[:, None] * CHUNK + (b * SUB + ss)[None, :]
        tl.store(t_tile + at, invert_block(tl.load(a_tile + at), SUB))
    tl.debug_barrier()
    for b in tl.static_range(1, NB):
        rows = (b * SUB + ss)[:, None] * CHUNK
        t_bb = tl.load(t_tile + rows + (b * SUB + ss)[None, :])
        for c in tl.static_range(b):
            acc = tl.zeros((SUB, SUB), dtype=tl.float32)
            for d in tl.static_range(c, b):
                a_bd = tl.load(a_tile + rows + (d * SUB + ss)[None, :])
                t_dc = tl.load(t_tile + (d * SUB + ss)[:, None] * CHUNK + (c * SUB + ss)[None, :])
                acc += tl.dot(a_bd, t_dc, input_precision="ieee")
            t_bc = -tl.dot(t_bb, acc, input_precision="ieee")
            tl.store(t_tile + rows + (c * SUB + ss)[None, :], t_bc)
        tl.debug_barrier()  # block row b is complete before row b + 1 reads it
    lower_blocks = (tt[:, None] // SUB) >= (tt[None, :] // SUB)
    return tl.load(t_tile + tt[:, None] * CHUNK + tt[None, :], mask=lower_blocks, other=0.0)
