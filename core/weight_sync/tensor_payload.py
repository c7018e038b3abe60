"""SGLang's ``serialized_named_tensors``: the tensors of one
``/update_weights_from_tensor`` call, as SGLang's and slime's senders write them.

The field is a list with one entry per tensor-parallel rank of the engine, each a
``MultiprocessingSerializer`` payload (base64 of a ``ForkingPickler`` pickle) holding
the full tensors by reference (CUDA IPC handles, or CPU shared memory), not their
bytes. ``load_format`` says what an entry holds:

* ``None`` or ``"direct"``: a list of ``(name, tensor)`` pairs;
* ``"flattened_bucket"`` (slime): ``{"flattened_tensor": t, "metadata": [...]}``,
  ``t`` one flat tensor and each metadata entry a tensor's name, shape, dtype and
  ``[start_idx, end_idx)`` in ``t``. SGLang's writer views ``t`` as bytes
  (``uint8``, indices in bytes, several dtypes per bucket); its older writer kept
  one dtype per bucket (``t`` in that dtype, indices in elements).

Entry ``r`` is tensor-parallel rank ``r``'s, as in SGLang (each scheduler opens
``serialized_named_tensors[tp_rank]``): on CUDA the entry's handles name that rank's
GPU. Each kvrunner rank opens its own entry in its own process
(:func:`rank_tensors`) and takes its shard of the full tensors itself, so every entry
must hold the same tensors (names, shapes, dtypes): entries that name different
tensors (a trainer routing experts to the ranks of an expert-parallel engine) would
leave each rank's shard of the others' tensors old, and are refused. The list must
hold exactly one entry per rank (:func:`check_entry_count`): SGLang's rank ``r``
indexes the list without a check, so a shorter list fails there, and a longer one
was written for another engine. Every entry is read by
:class:`~kvrunner.weight_sync.tensor_unpickler.TensorUnpickler`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kvrunner.models.tensor_checks import all_finite, tensor_problem
from kvrunner.models.weight_specs import TensorSpec
from kvrunner.weight_sync.errors import WeightSyncError
from kvrunner.weight_sync.tensor_unpickler import BucketEntry, unpickle_tensors

#: the load formats this reads (SGLang's names)
LOAD_FORMATS = (None, "direct", "flattened_bucket")


def check_entry_count(count: int, tensor_parallel_size: int) -> None:
    """Refuse a ``serialized_named_tensors`` of ``count`` entries for an engine of
    ``tensor_parallel_size`` ranks (one entry per rank), naming both numbers."""
    if count != tensor_parallel_size:
        raise WeightSyncError(
            f"serialized_named_tensors has {count} entries, but the engine has "
            f"{tensor_parallel_size} tensor-parallel ranks: it needs one entry per rank "
            f"(entry r is opened by rank r); nothing was loaded")


def named_tensors(serialized: Sequence[str | bytes], load_format: str | None,
                  rank: int = 0) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs entry ``rank`` of ``serialized`` holds;
    :class:`~kvrunner.weight_sync.WeightSyncError` names any fault."""
    if load_format not in LOAD_FORMATS:
        raise WeightSyncError(f"load_format {load_format!r} is not one kvrunner reads "
                              f"({', '.join(repr(f) for f in LOAD_FORMATS)})")
    if not serialized:
        raise WeightSyncError("serialized_named_tensors is empty: it needs one entry "
                              "per tensor-parallel rank")
    if not 0 <= rank < len(serialized):
        raise WeightSyncError(f"serialized_named_tensors has {len(serialized)} entries: "
                              f"none for tensor-parallel rank {rank}")
    where = f"serialized_named_tensors[{rank}]"
    payload = unpickle_tensors(serialized[rank], what=where)
    if load_format == "flattened_bucket":
        return bucket_tensors(payload)
    return _pairs(payload, where)


def rank_tensors(serialized: Sequence[str | bytes], load_format: str | None, rank: int, *,
                 check_finite: bool) -> list[tuple[str, torch.Tensor]]:
    """Rank ``rank``'s pairs (:func:`named_tensors`), every value checked as a pushed
    list is (a floating-point tensor off the meta device; with ``check_finite``, no
    NaN or inf: one pass over all of them, then tensor by tensor only to name the
    culprit); a refusal names the entry and the tensor."""
    pairs = named_tensors(serialized, load_format, rank)
    if check_finite:
        check_finite = not all_finite([t for _, t in pairs if t.is_floating_point()])
    for name, tensor in pairs:
        problem = tensor_problem(tensor, check_finite=check_finite)
        if problem is not None:
            raise WeightSyncError(f"serialized_named_tensors[{rank}]: tensor {name!r} "
                                  f"{problem}; nothing of this update was loaded")
    return pairs


def _pairs(payload: Any, where: str) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(payload, (list, tuple)):
        raise WeightSyncError(f"{where} holds {type(payload).__name__}, "
                              f"not a list of (name, tensor) pairs")
    pairs = []
    for i, pair in enumerate(payload):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2
                and isinstance(pair[0], str) and isinstance(pair[1], torch.Tensor)):
            raise WeightSyncError(f"{where}[{i}] is not a (name, tensor) "
                                  f"pair: {type(pair).__name__}")
        pairs.append((pair[0], pair[1]))
    return pairs


def bucket_tensors(bucket: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a flattened bucket (``{"flattened_tensor", "metadata"}``), views
    into its flat tensor, each entry checked against it first."""
    if not isinstance(bucket, dict) or set(bucket) != {"flattened_tensor", "metadata"}:
        keys = sorted(bucket) if isinstance(bucket, dict) else type(bucket).__name__
        raise WeightSyncError(f"a flattened bucket is {{'flattened_tensor', 'metadata'}}, "
                              f"got {keys}")
    flat, entries = bucket["flattened_tensor"], bucket["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise WeightSyncError("flattened_tensor must be a one-dimensional tensor")
    if not isinstance(entries, (list, tuple)):
        raise WeightSyncError(f"metadata is {type(entries).__name__}, not a list")
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, BucketEntry) or "name" not in vars(entry):
            raise WeightSyncError(f"metadata[{i}] is not a FlattenedTensorMetadata")
        out.append((entry.name, _view(flat, entry, f"metadata[{i}] ({entry.name})")))
    return out


def _view(flat: torch.Tensor, entry: BucketEntry, where: str) -> torch.Tensor:
    count = math.prod(entry.shape)
    if not 0 <= entry.start_idx <= entry.end_idx <= flat.numel():
        raise WeightSyncError(f"{where}: [{entry.start_idx}:{entry.end_idx}] runs outside "
                              f"the flattened tensor of {flat.numel()} elements")
    part = flat[entry.start_idx:entry.end_idx]
    if flat.dtype == entry.dtype or flat.dtype != torch.uint8:
        # one dtype per bucket: indices count elements (a dtype that differs is cast)
        if part.numel() != count or entry.numel != count:
            raise WeightSyncError(f"{where}: {part.numel()} elements for shape "
                                  f"{list(entry.shape)}")
        return part.view(entry.shape).to(entry.dtype)
    # a byte bucket: indices count bytes
    if part.numel() != count * entry.dtype.itemsize or entry.numel != part.numel():
        raise WeightSyncError(f"{where}: {part.numel()} bytes for shape {list(entry.shape)} "
                              f"of {entry.dtype}")
    if entry.start_idx % entry.dtype.itemsize:
        part = part.clone()  # packed without padding: a misaligned tensor is copied out
    return part.view(entry.dtype).view(entry.shape)


def check_entries_agree(specs_by_rank: Sequence[Sequence[TensorSpec]]) -> None:
    """Refuse entries that hold different tensors (each rank takes its shard of every
    tensor, so each must be given all of them), naming the first rank that differs
    from rank 0 and a tensor it lacks or holds otherwise."""
    first = {s.name: (s.shape, s.dtype) for s in specs_by_rank[0]}
    for rank, specs in enumerate(specs_by_rank[1:], start=1):
        held = {s.name: (s.shape, s.dtype) for s in specs}
        if held == first:
            continue
        differing = sorted(set(first) ^ set(held)) or sorted(
            name for name in first if first[name] != held[name])
        name = differing[0]
        raise WeightSyncError(
            f"serialized_named_tensors[0] and [{rank}] hold different tensors (first: "
            f"{name!r}: {_held(first, name)} vs {_held(held, name)}): kvrunner's ranks each "
            f"take their shard of every full tensor, so every entry must hold the same "
            f"tensors; nothing was loaded")


def _held(specs: dict[str, tuple[tuple[int, ...], str]], name: str) -> str:
    if name not in specs:
        return "absent"
    shape, dtype = specs[name]
    return f"{dtype} {list(shape)}"
