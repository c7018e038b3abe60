"""What every state-pool kernel reads first: its row's slots (imports Triton)."""

import triton
import triton.language as tl


@triton.jit
def row_slots(read_ptr, write_ptr, row, bound):
    """Row (or sequence) ``row``'s write and read slot, whether it runs (its write slot is
    not PAD), and ``bound`` folded with whether it runs and whether it reads a state:
    ``offsets < run_bound`` is empty for a PAD row, ``offsets < read_bound`` also for a row
    without history. Kernels mask with those because the Triton interpreter cannot AND a
    block mask with a scalar."""
    w_idx = tl.load(write_ptr + row).to(tl.int64)
    r_idx = tl.load(read_ptr + row).to(tl.int64)
    runs = w_idx >= 0
    reads = runs & (r_idx >= 0)
    return w_idx, r_idx, runs, tl.where(runs, bound, 0), tl.where(reads, bound, 0)
