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

kvrunner's ranks take their shards of full tensors themselves, so the first entry
is read and the others (the same tensors as the other ranks' senders hold them)
are left unopened. Every entry is read by
:class:`~kvrunner.weight_sync.tensor_unpickler.TensorUnpickler`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kvrunner.weight_sync.errors import WeightSyncError
from kvrunner.weight_sync.tensor_unpickler import BucketEntry, unpickle_tensors

#: the load formats this reads (SGLang's names)
LOAD_FORMATS = (None, "direct", "flattened_bucket")


def named_tensors(serialized: Sequence[str | bytes], load_format: str | None
                  ) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs the first entry of ``serialized`` holds;
    :class:`~kvrunner.weight_sync.WeightSyncError` names any fault."""
    if load_format not in LOAD_FORMATS:
        raise WeightSyncError(f"load_format {load_format!r} is not one kvrunner reads "
                              f"({', '.join(repr(f) for f in LOAD_FORMATS)})")
    if not serialized:
        raise WeightSyncError("serialized_named_tensors is empty: it needs one entry "
                              "per tensor-parallel rank")
    payload = unpickle_tensors(serialized[0], what="serialized_named_tensors[0]")
    if load_format == "flattened_bucket":
        return bucket_tensors(payload)
    return _pairs(payload)


def _pairs(payload: Any) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(payload, (list, tuple)):
        raise WeightSyncError(f"serialized_named_tensors[0] holds {type(payload).__name__}, "
                              f"not a list of (name, tensor) pairs")
    pairs = []
    for i, pair in enumerate(payload):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2
                and isinstance(pair[0], str) and isinstance(pair[1], torch.Tensor)):
            raise WeightSyncError(f"serialized_named_tensors[0][{i}] is not a (name, tensor) "
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
