"""Per-tensor digests of weights under their Hugging Face names, so a trainer can
check that a push landed: :func:`tensor_digests` on the trainer's full tensors equals
``LLM.weights_checksum()`` on the engine's (tensor-parallel shards merged).

The digest of a tensor is the wrapping 64-bit sum, over its elements, of a mix of
each element's flat index in the full tensor and the bits of its value in the
engine's dtype. A sum does not depend on where an element lives, so each rank adds
up the elements it holds, at the full-tensor positions its ``weight_loader`` put
them (found by loading the index tensor ``arange(numel)`` into a copy of the
parameter), and the driver adds the ranks' sums. Ranks that hold the same elements
(replicated norms, replicated KV heads) are counted once: their coverage
fingerprints agree, and so must their digests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from kvrunner.weight_sync.errors import WeightSyncError

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_K1, _K2 = -7046029254386353131, -4658895280553007687  # odd 64-bit constants


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ (x >> 31)) * _K1
    x = (x ^ (x >> 29)) * _K2
    return x ^ (x >> 32)


def _digest(index: torch.Tensor, values: torch.Tensor) -> int:
    bits = values.contiguous().view(_BITS[values.element_size()]).to(torch.int64)
    return int(_mix(_mix(index) + bits).sum())


def _hex(value: int) -> str:
    return f"{value & (2**64 - 1):016x}"


def tensor_digests(
    weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    dtype: torch.dtype,
) -> dict[str, str]:
    """The trainer's side: each full tensor's digest once cast to ``dtype`` (the
    engine's, ``llm.runner.dtype`` / the config's), as ``weights_checksum`` names it."""
    if isinstance(weights, Mapping):
        weights = weights.items()
    out = {}
    for name, tensor in weights:
        flat = tensor.detach().to(dtype).reshape(-1)
        out[name] = _hex(_digest(torch.arange(flat.numel(), device=flat.device), flat))
    return out


def rank_digests(model: Any) -> dict[str, tuple[int, int, int]]:
    """One rank's part: for every name loaded so far, ``(digest, coverage, count)`` of
    the elements this rank holds."""
    params = dict(model.named_parameters())
    out = {}
    with torch.no_grad():
        for name, (pname, shard, shape) in model.__dict__.get("checkpoint_layout", {}).items():
            param = params[pname]
            loader = getattr(param, "weight_loader", None)
            where = torch.full(param.shape, -1, dtype=torch.int64, device=param.device)
            numel = int(torch.tensor(shape).prod()) if shape else 1
            index = torch.arange(numel, dtype=torch.int64, device=param.device).view(shape)
            if loader is None:
                where.copy_(index)
            else:
                loader(where, index, shard)
            held = where >= 0
            positions = where[held]
            out[name] = (_digest(positions, param[held]), int(_mix(positions).sum()),
                         positions.numel())
            del where, index
    return out


def merge_digests(per_rank: list[dict[str, tuple[int, int, int]]],
                  shapes: Mapping[str, int] | None = None) -> dict[str, str]:
    """The driver's side: every rank's sums added, a replicated part counted once.
    Raises :class:`WeightSyncError` if replicas of the same elements disagree."""
    out = {}
    for name in per_rank[0]:
        parts: dict[int, tuple[int, int]] = {}
        for rank, digests in enumerate(per_rank):
            digest, cover, count = digests[name]
            if cover in parts and parts[cover][0] != digest:
                raise WeightSyncError(f"tensor {name!r}: rank {rank} holds a replica that "
                                      f"differs from a lower rank's")
            parts[cover] = (digest, count)
        out[name] = _hex(sum(d for d, _ in parts.values()))
    return out
