"""Linear layers that know how to take their shard of a full checkpoint weight.

Every layer here holds only this rank's slice of the weight and loads it from the
*full* tensor a checkpoint stores, through ``param.weight_loader(param, full,
shard_id)``. With ``tp.size == 1`` (the default) each layer is an ordinary
``F.linear``; tensor parallelism later only has to hand in a :class:`TPGroup`
whose collectives are real.

- :class:`ColumnParallelLinear` splits the output features (no communication).
- :class:`RowParallelLinear` splits the input features and all-reduces the output.
- :class:`QKVParallelLinear` / :class:`MergedColumnParallelLinear` fuse several
  projections into one matmul (one kernel launch instead of three / two); the
  checkpoint's separate tensors load into their slices by shard id.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from kvrunner.layers.activation import silu_and_mul
from kvrunner.layers.batch_invariant import invariant_linear, invariant_silu_mul_linear
from kvrunner.layers.fp8.choice import building_quantization
from kvrunner.layers.fp8.gemm import fp8_linear
from kvrunner.layers.fp8.weights import check_part_alignment, load_fp8_part, make_fp8_params
from kvrunner.layers.fused.dispatch import batch_invariant, use_skinny_gemm
from kvrunner.layers.weight_copy import copy_weight_

Collective = Callable[[torch.Tensor], torch.Tensor]


def project(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)``; a decode row takes the skinny-GEMM kernel where it was
    measured faster than cuBLAS (``[kernels] skinny_gemm``, see ``layers/fused/dispatch.py``);
    in deterministic mode every row is computed as alone (``layers/batch_invariant.py``)."""
    if batch_invariant():
        return invariant_linear(x, weight)
    if use_skinny_gemm(x, weight):
        from kvrunner.layers.fused.skinny_gemm_triton import skinny_gemm

        return skinny_gemm(x, weight)
    return F.linear(x, weight)


def project_silu_mul(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``project(silu(gate) * up, weight)`` for ``gate_up = [gate | up]``: one launch
    where the rows take the skinny GEMM (it forms the input as it reads it, the same
    roundings; the rows :func:`use_skinny_gemm` allows) or, in deterministic mode, the
    invariant GEMM (``invariant_silu_mul_linear``), else the activation's kernel and
    then :func:`project`."""
    if batch_invariant():
        return invariant_silu_mul_linear(gate_up, weight)
    if gate_up.shape[-1] == 2 * weight.shape[-1] and use_skinny_gemm(gate_up, weight):
        from kvrunner.layers.fused.skinny_gemm_triton import skinny_gemm

        return skinny_gemm(gate_up, weight, silu_mul=True)
    return project(silu_and_mul(gate_up), weight)


@attrs.frozen(kw_only=True)
class TPGroup:
    """This rank's place in a tensor-parallel group and the collectives it uses.

    ``all_reduce`` sums a tensor over the group; ``all_gather`` concatenates each
    rank's tensor along the last dimension, in rank order. Both are required when
    ``size > 1`` and unused (identity) when ``size == 1``.
    """

    rank: int = 0
    size: int = 1
    all_reduce: Collective | None = None
    all_gather: Collective | None = None

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TPGroup: rank {self.rank} is outside a group of size {self.size}")
        if self.size > 1 and (self.all_reduce is None or self.all_gather is None):
            raise ValueError("TPGroup: size > 1 needs all_reduce and all_gather collectives")

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.size == 1 else self.all_reduce(x)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.size == 1 else self.all_gather(x)


#: The group of one: no sharding, no communication.
SINGLE = TPGroup()


def divide(numerator: int, denominator: int, what: str, *, by: str = "tensor_parallel_size"
           ) -> int:
    """``numerator / denominator``, refusing a split that would not be exact.

    :param what: names the numerator; :param by: names the denominator.
    """
    if numerator % denominator:
        raise ValueError(f"{what}: {numerator} is not divisible by {by}={denominator}")
    return numerator // denominator


def kv_replicas(num_kv_heads: int, tp_size: int) -> int:
    """Ranks sharing each KV head when there are fewer KV heads than ranks."""
    if tp_size % num_kv_heads:
        raise ValueError(
            f"KV heads: {num_kv_heads} is not divisible by tensor_parallel_size={tp_size}, "
            f"nor is {tp_size} a multiple of {num_kv_heads} (to replicate each KV head); use "
            f"a tensor_parallel_size that divides {num_kv_heads} or is a multiple of it"
        )
    return tp_size // num_kv_heads


def _shard(
    loaded: torch.Tensor, dim: int, index: int, size: int, total: int, what: str
) -> torch.Tensor:
    """Slice number ``index`` (``size`` wide) along ``dim`` of a tensor ``total`` wide."""
    if loaded.dim() <= dim or loaded.shape[dim] != total:
        raise ValueError(
            f"{what}: expected {total} along dim {dim}, got shape {tuple(loaded.shape)}"
        )
    return loaded.narrow(dim, index * size, size)


class LinearBase(nn.Module):
    """``y = x @ W.T (+ b)`` with a rank-local ``W`` of ``[out_local, in_local]``.

    A quantizable layer built under ``quantization="fp8"``
    (:func:`~kvrunner.layers.fp8.choice.building_with`) holds ``W`` in FP8 with its
    128 x 128 block scales (``layers/fp8/``); the bias stays in the model dtype.
    """

    #: whether ``quantization`` applies (the parallel projections; not a router)
    quantizable = False

    def __init__(
        self,
        in_local: int,
        out_local: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TPGroup,
    ) -> None:
        super().__init__()
        self.tp = tp
        #: the weight is FP8 with block scales (``weight_scale_inv``)
        self.fp8 = self.quantizable and building_quantization() == "fp8"
        if self.fp8:
            make_fp8_params(self, out_local, in_local, device)
        else:
            self.weight = nn.Parameter(
                torch.empty(out_local, in_local, dtype=dtype, device=device),
                requires_grad=False,
            )
            self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(
                torch.empty(out_local, dtype=dtype, device=device), requires_grad=False
            )
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        """Copy the full checkpoint tensor ``loaded`` (replicated layers take it whole)."""
        copy_weight_(param, loaded, what=type(self).__name__)

    def _load_part(self, param: nn.Parameter, loaded: torch.Tensor, *, dim: int, index: int,
                   size: int, total: int, offset: int = 0, what: str) -> None:
        """Place part ``index`` (``size`` wide along ``dim`` of a tensor ``total`` wide)
        at local rows ``offset`` (dim 0) or over the whole parameter (dim 1); an FP8
        weight or its scales through :func:`~kvrunner.layers.fp8.weights.load_fp8_part`."""
        if self.fp8 and param.dim() == 2:
            load_fp8_part(self.weight, self.weight_scale_inv, param, loaded, dim=dim,
                          index=index, size=size, total=total, offset=offset, what=what)
            return
        shard = _shard(loaded, dim, index, size, total, what)
        copy_weight_(param.narrow(0, offset, size) if dim == 0 else param, shard, what=what)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` without the bias."""
        if self.fp8:
            return fp8_linear(x, self.weight, self.weight_scale_inv)
        return project(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return self._product(x)
        if self.fp8:
            return fp8_linear(x, self.weight, self.weight_scale_inv, self.bias)
        if batch_invariant():
            return invariant_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (a MoE router, the shared expert's gate)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 dtype: torch.dtype, device: torch.device | str, tp: TPGroup = SINGLE) -> None:
        super().__init__(in_features, out_features, bias=bias, dtype=dtype, device=device, tp=tp)


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks; each rank returns its slice of ``y``."""

    quantizable = True

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 dtype: torch.dtype, device: torch.device | str, tp: TPGroup = SINGLE) -> None:
        out_local = divide(out_features, tp.size, "ColumnParallelLinear output features")
        super().__init__(in_features, out_local, bias=bias, dtype=dtype, device=device, tp=tp)
        if self.fp8 and type(self) is ColumnParallelLinear:
            check_part_alignment(type(self).__name__, [r * out_local for r in range(tp.size)])

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        rows = self.weight.shape[0]
        self._load_part(param, loaded, dim=0, index=self.tp.rank, size=rows,
                        total=rows * self.tp.size, what=type(self).__name__)


class RowParallelLinear(LinearBase):
    """Input features split over ranks; the partial products are summed over ranks.

    The bias is added once, after the reduction, so it is not counted ``size`` times.
    ``reduce_output=False`` returns this rank's partial sum instead, for a caller that
    adds more partial sums first and reduces them all in one all-reduce (no bias then).
    """

    quantizable = True

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 dtype: torch.dtype, device: torch.device | str, tp: TPGroup = SINGLE,
                 reduce_output: bool = True) -> None:
        if bias and not reduce_output:
            raise ValueError("RowParallelLinear: a bias needs reduce_output (it is added once)")
        in_local = divide(in_features, tp.size, "RowParallelLinear input features")
        super().__init__(in_local, out_features, bias=bias, dtype=dtype, device=device, tp=tp)
        self.reduce_output = reduce_output
        if self.fp8:
            check_part_alignment(type(self).__name__, [r * in_local for r in range(tp.size)])

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if param.dim() == 1:  # bias: replicated
            copy_weight_(param, loaded, what=type(self).__name__)
            return
        cols = self.weight.shape[1]
        self._load_part(param, loaded, dim=1, index=self.tp.rank, size=cols,
                        total=cols * self.tp.size, what=type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduced(self._product(x))

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``self(silu(gate) * up)`` for a SwiGLU MLP's ``[gate | up]`` (this rank's
        slices), with the activation fused into a one-row product."""
        if self.fp8:
            return self._reduced(self._product(silu_and_mul(gate_up)))
        return self._reduced(project_silu_mul(gate_up, self.weight))

    def _reduced(self, y: torch.Tensor) -> torch.Tensor:
        if not self.reduce_output:
            return y
        y = self.tp.reduce(y)
        return y if self.bias is None else y + self.bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one weight.

    Each rank's weight is the concatenation of its slice of every part, so the
    output splits back into parts with :meth:`torch.Tensor.split` on local sizes.
    Shard ids are the part indices ``0, 1, ...`` (gate=0, up=1 for an MLP).
    """

    def __init__(self, in_features: int, part_sizes: Sequence[int], *, bias: bool = False,
                 dtype: torch.dtype, device: torch.device | str, tp: TPGroup = SINGLE) -> None:
        self.local_sizes = [divide(s, tp.size, "MergedColumnParallelLinear part")
                            for s in part_sizes]
        super().__init__(in_features, sum(part_sizes), bias=bias, dtype=dtype, device=device, tp=tp)
        if self.fp8:
            check_part_alignment(type(self).__name__, [
                sum(self.local_sizes[:i]) for i in range(len(self.local_sizes))
            ] + [r * s for s in self.local_sizes for r in range(tp.size)])

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.local_sizes):
            raise ValueError(f"MergedColumnParallelLinear: bad shard id {shard_id!r}")
        size = self.local_sizes[shard_id]
        self._load_part(param, loaded, dim=0, index=self.tp.rank, size=size,
                        total=size * self.tp.size, offset=sum(self.local_sizes[:shard_id]),
                        what=f"{type(self).__name__} part {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections in one weight, split by heads over ranks.

    Query heads are divided over ranks. When there are fewer KV heads than ranks,
    each KV head is replicated on ``size // num_kv_heads`` consecutive ranks (as
    GQA needs every query head's KV head on the same rank). Shard ids: ``"q"``,
    ``"k"``, ``"v"``.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, *,
                 bias: bool = False, dtype: torch.dtype, device: torch.device | str,
                 tp: TPGroup = SINGLE) -> None:
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = divide(num_heads, tp.size, "QKVParallelLinear query heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = divide(num_kv_heads, tp.size, "QKVParallelLinear KV heads")
            self.kv_shard = tp.rank
        else:
            replicas = kv_replicas(num_kv_heads, tp.size)
            self.num_kv_heads = 1
            self.kv_shard = tp.rank // replicas
        out_local = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        # Skip ColumnParallelLinear.__init__: the local width is per head group, not out/size.
        LinearBase.__init__(
            self, hidden_size, out_local, bias=bias, dtype=dtype, device=device, tp=tp
        )
        if self.fp8:
            check_part_alignment(type(self).__name__, [
                0, self.q_size, self.q_size + self.kv_size,
                tp.rank * self.q_size, self.kv_shard * self.kv_size])

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if shard_id == "q":
            offset, size, index = 0, self.q_size, self.tp.rank
            total = self.total_num_heads * self.head_dim
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, index = self.kv_size, self.kv_shard
            total = self.total_num_kv_heads * self.head_dim
        else:
            raise ValueError(f"QKVParallelLinear: bad shard id {shard_id!r} (want 'q', 'k' or 'v')")
        self._load_part(param, loaded, dim=0, index=index, size=size, total=total,
                        offset=offset, what=f"QKVParallelLinear {shard_id}_proj")

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, q+k+v]`` -> ``q [T, q_size]``, ``k [T, kv_size]``, ``v [T, kv_size]``."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
