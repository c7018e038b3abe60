"""What every gated-delta-rule entry takes: one step's tensors over a state pool.

The decode entries (``fused_recurrent*``) take one token per sequence, so row ``b`` is
sequence ``b`` and ``cu_seqlens`` stays ``None``; the chunked entries (``chunk*``)
take concatenated sequences, sequence ``s`` owning rows
``cu_seqlens[s]:cu_seqlens[s+1]``. Either way sequence ``s`` starts from
``state[read_indices[s]]`` (zeros when it is < 0), its final state goes to
``state[write_indices[s]]``, and a sequence whose write index is < 0 (PAD) reads
nothing, writes nothing and outputs zeros.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from kvrunner_gdn.ops.gated_delta_rule.naive import l2norm
from kvrunner_gdn.ops.utils import DEFAULT_CHUNK, check_indices


@attrs.frozen(kw_only=True)
class GatedDeltaRuleInputs:
    """One step's inputs; ``state`` is updated in place by every entry."""

    q: torch.Tensor  #: ``[T, Hk, K]``
    k: torch.Tensor  #: ``[T, Hk, K]``
    v: torch.Tensor  #: ``[T, Hv, V]``; the output has its dtype
    g: torch.Tensor  #: ``[T, Hv]`` log-decay
    beta: torch.Tensor  #: ``[T, Hv]`` write strength
    state: torch.Tensor  #: ``[N, Hv, K, V]`` fp32, contiguous: the pool
    read_indices: torch.Tensor  #: ``[S]`` int: the slot each sequence starts from
    write_indices: torch.Tensor  #: ``[S]`` int: the slot its final state goes to
    scale: float  #: the query scale (``K ** -0.5`` for the model)
    use_qk_l2norm: bool = True
    #: chunked entries: ``[S + 1]`` int32 sequence offsets into the rows
    cu_seqlens: torch.Tensor | None = None
    #: the host copy of ``cu_seqlens``, which spares a device sync where an entry needs it
    cu_seqlens_host: Sequence[int] | None = None
    #: tokens per chunk (each kernel rounds it to the tile it runs; the result does not
    #: depend on it)
    chunk_size: int = DEFAULT_CHUNK
    #: host copies of ``(read_indices, write_indices)``: fla's wrapper plans its call
    #: on them (the result is the same without)
    host_indices: tuple[Sequence[int], Sequence[int]] | None = None

    def sequences(self, *, chunked: bool) -> int:
        """Check shapes, strides and indices for a chunked (varlen) or a decode entry;
        the number of sequences."""
        q, k, v, g, beta, state = self.q, self.k, self.v, self.g, self.beta, self.state
        rows, num_k_heads, head_k = k.shape
        num_v_heads, head_v = v.shape[1:]
        if q.shape != k.shape or v.shape[0] != rows or g.shape != (rows, num_v_heads):
            raise ValueError(f"bad shapes q {q.shape} k {k.shape} v {v.shape} g {g.shape}")
        if beta.shape != g.shape or num_v_heads % num_k_heads:
            raise ValueError(f"beta {beta.shape} must match g; Hv must be a multiple of Hk")
        if state.shape[1:] != (num_v_heads, head_k, head_v) or state.dtype != torch.float32:
            raise ValueError(f"state pool {tuple(state.shape)} {state.dtype} does not match heads")
        if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or not state.is_contiguous():
            raise ValueError("q/k/v need a unit last-dim stride and the state pool must be "
                             "contiguous")
        if chunked != (self.cu_seqlens is not None):
            raise ValueError("a chunked entry needs cu_seqlens; a decode entry takes one token "
                             "per sequence and none")
        seqs = rows if self.cu_seqlens is None else self.cu_seqlens.shape[0] - 1
        check_indices("read_indices", self.read_indices, seqs)
        check_indices("write_indices", self.write_indices, seqs)
        return seqs

    @property
    def group(self) -> int:
        """Value heads per key head: value head ``h`` reads key head ``h // group``."""
        return self.v.shape[1] // self.k.shape[1]

    def value_head_qk(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch paths' q and k: fp32, L2-normalised if asked, q scaled, both repeated
        to one head per value head (``[T, Hv, K]``)."""
        qf, kf = self.q.float(), self.k.float()
        if self.use_qk_l2norm:
            qf, kf = l2norm(qf), l2norm(kf)
        return ((qf * self.scale).repeat_interleave(self.group, dim=1),
                kf.repeat_interleave(self.group, dim=1))
