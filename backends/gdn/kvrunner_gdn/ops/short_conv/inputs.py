"""What every short-conv entry takes: one step's inputs over a conv-state pool.

The decode entries (``update*``) take one new token per sequence (row ``b`` is
sequence ``b``, ``cu_seqlens`` stays ``None``); the prefill entries take concatenated
sequences, sequence ``s`` owning rows ``cu_seqlens[s]:cu_seqlens[s+1]`` of ``x``.
Sequence ``s``'s left context is ``conv_state[read_indices[s]]`` (the previous
``K - 1`` inputs, oldest first; zeros when the index is < 0); afterwards its last
``K - 1`` inputs are ``conv_state[write_indices[s]]``. A sequence whose write index is
< 0 (PAD) reads nothing, writes nothing and outputs zeros.
"""

from __future__ import annotations

import attrs
import torch

from kvrunner_gdn.ops.utils import check_indices


@attrs.frozen(kw_only=True)
class ShortConvInputs:
    """One step's inputs; ``conv_state`` is updated in place by every entry."""

    x: torch.Tensor  #: ``[T, D]``; the output has its dtype and shape
    conv_state: torch.Tensor  #: ``[N, D, K - 1]``: the pool
    weight: torch.Tensor  #: ``[D, K]``; tap ``K - 1`` multiplies the current token
    bias: torch.Tensor | None = None  #: ``[D]``
    read_indices: torch.Tensor  #: ``[S]`` int: the slot each sequence's context is read from
    write_indices: torch.Tensor  #: ``[S]`` int: the slot its last inputs go to
    #: SiLU after the conv (the model's)
    activation: bool = True
    #: prefill entries: ``[S + 1]`` int32 sequence offsets into the rows of ``x``
    cu_seqlens: torch.Tensor | None = None
    #: prefill: the longest sequence (a host int: the Triton launch sizes its grid by it)
    max_seqlen: int | None = None
    #: prefill: ``cu_seqlens[-1]`` where the host knows it; equal to ``T``, the Triton
    #: path spares zeroing an output every row of which it writes
    total_tokens: int | None = None

    def sequences(self, *, varlen: bool) -> int:
        """Check shapes and indices for a prefill (varlen) or a decode entry; the number
        of sequences."""
        x, state, weight = self.x, self.conv_state, self.weight
        if x.dim() != 2 or weight.dim() != 2 or state.dim() != 3:
            raise ValueError("expected x [T, D], weight [D, K], conv_state [N, D, K-1]")
        if state.shape[1:] != (x.shape[1], weight.shape[1] - 1) or weight.shape[0] != x.shape[1]:
            raise ValueError(
                f"shape mismatch: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                f"conv_state {tuple(state.shape)}"
            )
        if varlen != (self.cu_seqlens is not None):
            raise ValueError("a prefill entry needs cu_seqlens; a decode entry takes one token "
                             "per sequence and none")
        if self.cu_seqlens is not None and self.cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be [S + 1], got {tuple(self.cu_seqlens.shape)}")
        seqs = x.shape[0] if self.cu_seqlens is None else self.cu_seqlens.shape[0] - 1
        check_indices("read_indices", self.read_indices, seqs)
        check_indices("write_indices", self.write_indices, seqs)
        return seqs
