"""The chunked prefill through flash-linear-attention's ``chunk_gated_delta_rule``.

Same contract as :func:`~kvrunner_gdn.ops.gated_delta_rule.chunk.chunk_gated_delta_rule`
(one :class:`~kvrunner_gdn.ops.gated_delta_rule.inputs.GatedDeltaRuleInputs`: q, k
``[T, Hk, K]``, v ``[T, Hv, V]``, g/beta ``[T, Hv]``, the fp32 pool ``[N, Hv, K, V]``,
per-sequence read/write indices with PAD = -1), computed by fla (fla-core, an
optional dependency: ``pip install kvrunner-gdn[fla]``). fla takes one varlen batch
``[1, T, H, ...]`` with ``cu_seqlens``, starts sequence ``s`` from ``initial_state[s]``
and returns the final states ``[N, Hv, K, V]`` (fp32); it cannot index a pool. So:

1. gather each sequence's initial state through its read index (zeros where the read
   index is PAD, or the row itself is PAD: as in our kernels, a fresh slot is never read);
2. run fla over the whole step;
3. zero the output rows of PAD sequences (and rows past the last sequence);
4. copy each final state into the pool through its write index, and nowhere for a
   PAD row.

No step reads a device value on the host or waits for the device: fla gets its chunk
map built from the host copy of ``cu_seqlens`` (:func:`fla_chunk_indices`; with each
sequence's first chunk as well, :func:`fla_chunk_maps`, when the kernel is the direct
forward of :mod:`kvrunner_gdn.ops.gated_delta_rule.fla_forward`), and the scatter avoids a boolean
mask (see :func:`_scatter`).

With the host copies of the indices as well (``inputs.host_indices``, which the layer's
metadata carries), the common steps skip the general path's work, all of it small
torch ops whose launches cost more host time than fla's own at T = 4096: when every
row runs and the sequences cover every token row, there is nothing to zero and the
scatter is one ``index_copy_``; fresh rows need no gather (fla starts from zeros
without an initial state) and continuing rows a plain one; and one sequence takes
fla's plain call, without offsets (fla's varlen call costs more host time), its states
as slices of the pool. PAD rows take the general path.

fla's numerics are its own: q and k are rounded to the input dtype after its L2 norm,
its per-chunk states are rounded to the input dtype for the matrix products, and
float32 inputs go through TF32 products on GPUs that have them. The value heads map
to key heads as ours do (head ``h`` reads key head ``h // (Hv // Hk)``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvrunner.plugin_api import on_device
from kvrunner_gdn.ops.gated_delta_rule.chunk_torch import chunk_gated_delta_rule_torch
from kvrunner_gdn.ops.gated_delta_rule.fla_forward import FlaDirectForward, fla_direct_forward
from kvrunner_gdn.ops.gated_delta_rule.inputs import GatedDeltaRuleInputs
from kvrunner_gdn.ops.utils import dot_block, valid_rows

#: fla's chunk kernels keep the state in 64-row blocks of K, at most four (fla asserts it)
FLA_MAX_HEAD_K = 256

FlaChunk = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def fla_chunk_kernel() -> FlaChunk | None:
    """fla's chunked forward: where it binds, fla's forward functions without its
    training-op layers (:func:`.fla_forward.fla_direct_forward`, the public call's result
    at less host time), else the public ``chunk_gated_delta_rule``;
    ``None`` where fla does not import."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # not installed, or built against another torch/triton
        return None
    return fla_direct_forward() or chunk_gated_delta_rule


def fla_chunk_size(chunk_size: int) -> int:
    """fla accepts chunks of 16, 32 or 64 tokens: the request rounded up to a power of two
    >= 16 (as our kernel does), at most 64. The result does not depend on it."""
    return min(64, dot_block(chunk_size))


def _chunk_pairs(cu_seqlens_host: Sequence[int], chunk: int) -> tuple[list[int], list[int]]:
    """``[sequence, chunk within it]`` for every chunk of every sequence (flattened), and
    each sequence's first chunk, with the total last."""
    pairs, offsets = [], [0]
    for s, (lo, hi) in enumerate(zip(cu_seqlens_host[:-1], cu_seqlens_host[1:], strict=True)):
        chunks = -(-(hi - lo) // chunk)
        for c in range(chunks):
            pairs += (s, c)
        offsets.append(offsets[-1] + chunks)
    return pairs, offsets


def fla_chunk_indices(cu_seqlens_host: Sequence[int], chunk: int,
                      device: torch.device) -> torch.Tensor:
    """fla's ``chunk_indices`` (a documented argument): ``[sequence, chunk within it]``
    for every chunk of every sequence, ``[NT, 2]`` int64. Built on the host and copied
    from pinned memory without blocking, where fla would copy from pageable memory, which
    waits for the device to drain."""
    return on_device(_chunk_pairs(cu_seqlens_host, chunk)[0], torch.long, device).reshape(-1, 2)


def fla_chunk_maps(cu_seqlens_host: Sequence[int], chunk: int,
                   device: torch.device) -> dict[str, torch.Tensor]:
    """:func:`fla_chunk_indices` and fla's ``chunk_offsets`` (each sequence's first chunk,
    ``[N + 1]`` int64, which the direct forward takes), in one copy."""
    pairs, offsets = _chunk_pairs(cu_seqlens_host, chunk)
    both = on_device(pairs + offsets, torch.long, device)
    return {"chunk_indices": both[: len(pairs)].view(-1, 2), "chunk_offsets": both[len(pairs):]}


def _varlen_maps(kernel: FlaChunk, cu_seqlens_host: Sequence[int], chunk: int,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """The chunk maps ``kernel`` takes: the offsets too for the direct forward."""
    if isinstance(kernel, FlaDirectForward):
        return fla_chunk_maps(cu_seqlens_host, chunk, device)
    return {"chunk_indices": fla_chunk_indices(cu_seqlens_host, chunk, device)}


def _initial_states(state: torch.Tensor, read: torch.Tensor, reads: torch.Tensor) -> torch.Tensor:
    """``state[read[s]]`` where ``reads[s]``, zeros elsewhere: fla's initial states."""
    # torch.where, not a product: a fresh slot may hold NaN and must not leak in.
    return torch.where(reads[:, None, None, None], state[read.clamp(min=0)], 0.0)


def _scatter(state: torch.Tensor, final: torch.Tensor, write: torch.Tensor,
             runs: torch.Tensor) -> None:
    """``state[write[s]] = final[s]`` for every row with ``write[s] >= 0``, no other slot
    changed, without a device-to-host sync. A PAD row is pointed at the slot of the first
    running row with that row's own final state (a duplicate write of identical bytes),
    or, when no row runs, at slot 0 with slot 0's current bytes. ``runs`` is
    ``write >= 0``."""
    # One-element index tensors throughout: indexing with a 0-dim device tensor reads
    # it on the host (a sync), index_select does not.
    first = torch.argmax(runs.to(torch.int32)).view(1)  # the first running row; 0 if none
    any_run = runs.index_select(0, first)
    spare_slot = torch.where(any_run, write.index_select(0, first), 0)
    spare_value = torch.where(any_run[:, None, None, None], final.index_select(0, first),
                              state[:1])
    index = torch.where(runs, write, spare_slot)
    source = torch.where(runs[:, None, None, None], final, spare_value)
    state.index_copy_(0, index, source)


def chunk_gated_delta_rule_fla(*, inputs: GatedDeltaRuleInputs,
                               kernel: FlaChunk | None = None) -> torch.Tensor:
    """Concatenated sequences by fla: ``[T, Hv, V]`` in v's dtype, rows of PAD sequences
    zero; the pool updated in place.

    ``kernel`` is fla's ``chunk_gated_delta_rule`` (looked up when ``None``; the layer
    binds it once). With ``inputs.host_indices`` and ``inputs.cu_seqlens_host``, a step
    of running rows skips the general path's masks (the result is the same).
    """
    x = inputs
    seqs = x.sequences(chunked=True)
    assert x.cu_seqlens is not None  # checked by sequences
    q, v, state = x.q, x.v, x.state
    if q.shape[0] == 0 or seqs == 0:
        # Nothing for fla to compute; a zero-length sequence still carries its state over.
        return chunk_gated_delta_rule_torch(inputs=x)
    kernel = kernel or fla_chunk_kernel()
    if kernel is None:
        raise RuntimeError("flash-linear-attention (fla-core) does not import here")
    batched = tuple(t[None] for t in (q, x.k, v, x.g, x.beta))  # fla's [1, T, ...] varlen layout
    call = dict(scale=x.scale, output_final_state=True, use_qk_l2norm_in_kernel=x.use_qk_l2norm,
                chunk_size=fla_chunk_size(x.chunk_size))
    cu_host = x.cu_seqlens_host
    if (x.host_indices is not None and cu_host is not None
            and all(w >= 0 for w in x.host_indices[1]) and cu_host[-1] == q.shape[0]):
        return _prefill_running_rows(kernel, batched, call, x).to(v.dtype)
    read, write = x.read_indices.long(), x.write_indices.long()
    runs, reads = valid_rows(read, write)
    initial = _initial_states(state, read, reads)
    cu = x.cu_seqlens.long()
    if cu_host is not None:  # without the host offsets, fla reads them (a sync)
        call |= _varlen_maps(kernel, cu_host, call["chunk_size"], cu.device)
    out, final = kernel(*batched, initial_state=initial, cu_seqlens=cu, **call)
    tokens = q.shape[0]
    # The sequence of every token row; rows past the last sequence get index `seqs`.
    rows = torch.arange(tokens, device=cu.device)
    seq_of_row = torch.searchsorted(cu, rows, right=True) - 1
    keep = torch.cat([runs, runs.new_zeros(1)])[seq_of_row]
    # fla leaves rows outside every sequence unwritten: select, so garbage cannot leak.
    out = torch.where(keep[:, None, None], out[0].to(v.dtype), 0)
    _scatter(state, final, write, runs)
    return out


def _prefill_running_rows(kernel: FlaChunk, batched: tuple[torch.Tensor, ...],
                          call: dict[str, Any], x: GatedDeltaRuleInputs) -> torch.Tensor:
    """fla's output ``[T, Hv, V]`` for a step whose rows all run and whose sequences
    cover every token row: no output row to zero and no PAD row to steer, so the work
    is fla's call plus one state write. The host indices pick the fewest launches."""
    assert x.host_indices is not None and x.cu_seqlens_host is not None and x.cu_seqlens is not None
    reads_host, writes_host = x.host_indices
    state = x.state
    if len(reads_host) == 1:
        # One sequence: fla's plain call (no offsets); its states are slices of the pool.
        r, w = reads_host[0], writes_host[0]
        out, final = kernel(*batched, initial_state=state[r : r + 1] if r >= 0 else None, **call)
        state[w : w + 1].copy_(final)
        return out[0]
    if all(r >= 0 for r in reads_host):  # every row continues: a plain gather
        initial = state.index_select(0, x.read_indices)
    elif any(r >= 0 for r in reads_host):
        read = x.read_indices.long()
        initial = _initial_states(state, read, read >= 0)
    else:  # every row fresh: no initial state, fla starts from zeros
        initial = None
    maps = _varlen_maps(kernel, x.cu_seqlens_host, call["chunk_size"], x.cu_seqlens.device)
    out, final = kernel(*batched, initial_state=initial, cu_seqlens=x.cu_seqlens.long(), **maps,
                        **call)
    state.index_copy_(0, x.write_indices.long(), final)
    return out[0]
