"""vLLM's IPC weight transfer (``--weight-transfer-config '{"backend": "ipc"}'``): the
tensors of one ``/update_weights`` call as CUDA IPC handles into a colocated
trainer's memory.

The trainer announces ``names``, ``dtype_names`` and ``shapes`` and sends, pickled
and base64-encoded (``ipc_handles_pickled``), what torch's ``reduce_tensor`` made
of its tensors: the arguments of ``torch.multiprocessing.reductions.
rebuild_cuda_tensor``, keyed by the UUID of the GPU that holds them. Two forms:

* one handle per tensor: a list, entry ``i`` ``{gpu_uuid: handle}`` for ``names[i]``;
* packed: one ``{gpu_uuid: handle}`` for a flat ``uint8`` buffer holding the
  tensors' bytes back to back, ``tensor_sizes[i]`` bytes for ``names[i]``;
* packed by elements (SkyRL's worker extension, ``update_weights_ipc``): one
  ``{gpu_uuid: handle}`` for a flat buffer of the tensors' one dtype, ``sizes[i]``
  elements for ``names[i]`` (``element_sizes`` here).

A handle is ``(rebuild_cuda_tensor, args)`` (vLLM before its trainer engines, SkyRL)
or ``args`` alone (vLLM since); ``args[6]`` is the sender's device index, which
the engine replaces with its own (the UUID names the GPU in any numbering). A dict
holds one entry per GPU of the trainer (its ranks' handles merged), and each
engine rank opens the entry of its own GPU: with tensor parallelism every rank is
given the full tensors and takes its shard.

Everything the payload says is checked before a handle is opened
(:func:`read_handles`): the pickle by
:class:`~kvrunner.weight_sync.tensor_unpickler.IpcHandleUnpickler`, the form, every
argument's type, each handle's tensor against the announced dtype and shape (or,
packed, each size against its dtype and shape and the buffer's length), and each
tensor within its storage. :func:`open_handles` then finds the rank's own GPU
among the keys (another GPU is refused naming both) and opens the handles.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from kvrunner.models.tensor_checks import all_finite, tensor_problem
from kvrunner.models.weight_specs import TensorSpec
from kvrunner.weight_sync.errors import WeightSyncError
from kvrunner.weight_sync.ipc_mappings import IpcMappings
from kvrunner.weight_sync.layout import DTYPES
from kvrunner.weight_sync.tensor_unpickler import CUDA_IPC_REBUILD, IpcGlobal, unpickle_ipc_handles
from kvrunner.weight_sync.update_group import announced_specs

#: how many arguments torch's rebuild_cuda_tensor takes
_NUM_ARGS = 15
#: the classes the tensor and storage arguments may name
_TENSOR_CLASSES = (torch.Tensor, torch.nn.Parameter)
_STORAGE_CLASSES = (torch.TypedStorage, torch.UntypedStorage)


@attrs.frozen
class IpcUpdate:
    """One ``update_info`` of vLLM's IPC backend: the announcement and the pickled
    handles (plain data: it travels to every rank, which reads it itself)."""

    names: tuple[str, ...]
    dtype_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    #: ``ipc_handles_pickled``: base64 text or the pickle's bytes
    handles_pickled: str | bytes
    #: packed: each tensor's bytes in the buffer (None: one handle per tensor)
    tensor_sizes: tuple[int, ...] | None = None
    #: what the sender said of the form (vLLM's per-update ``packed``); None: the
    #: handles' form decides
    packed: bool | None = None
    #: packed by elements: each tensor's element count in a buffer of their one dtype
    #: (SkyRL's ``sizes``); exclusive with ``tensor_sizes``
    element_sizes: tuple[int, ...] | None = None

    @classmethod
    def of(cls, names: Sequence[str], dtype_names: Sequence[str],
           shapes: Sequence[Sequence[int]], *, ipc_handles: Any = None,
           ipc_handles_pickled: str | bytes | None = None,
           tensor_sizes: Sequence[int] | None = None, packed: bool | None = None,
           element_sizes: Sequence[int] | None = None,
           ) -> IpcUpdate:
        """An update from vLLM's fields: exactly one of ``ipc_handles`` (the objects
        ``reduce_tensor`` made, as vLLM's Ray client passes them; pickled here) and
        ``ipc_handles_pickled`` (base64 text, as its HTTP client sends them); at most
        one of ``tensor_sizes`` (bytes) and ``element_sizes`` (SkyRL's ``sizes``)."""
        if (ipc_handles is None) == (ipc_handles_pickled is None):
            raise WeightSyncError("give exactly one of ipc_handles and ipc_handles_pickled"
                                  if ipc_handles is not None else
                                  "update_info needs ipc_handles_pickled (or ipc_handles)")
        if ipc_handles is not None:
            ipc_handles_pickled = pickle.dumps(ipc_handles)
        for field, values in (("dtype_names", dtype_names), ("shapes", shapes)):
            if len(values) != len(names):
                raise WeightSyncError(f"update_info.{field} has {len(values)} entries for "
                                      f"{len(names)} names")
        if tensor_sizes is not None and element_sizes is not None:
            raise WeightSyncError("update_info gives both tensor_sizes (bytes) and sizes "
                                  "(elements): give one")
        for field, sizes in (("tensor_sizes", tensor_sizes), ("sizes", element_sizes)):
            if sizes is not None and len(sizes) != len(names):
                raise WeightSyncError(f"update_info.{field} has {len(sizes)} entries for "
                                      f"{len(names)} names")
        return cls(tuple(names), tuple(dtype_names), tuple(tuple(s) for s in shapes),
                   ipc_handles_pickled,
                   None if tensor_sizes is None else tuple(tensor_sizes), packed,
                   None if element_sizes is None else tuple(element_sizes))

    def specs(self) -> list[TensorSpec]:
        """The announced tensors (a dtype weights cannot have is refused by name)."""
        return announced_specs(list(self.names), list(self.dtype_names),
                               [list(s) for s in self.shapes])


@attrs.frozen
class ReadHandles:
    """An update's handles, checked: per tensor (``packed`` false) or one buffer."""

    packed: bool
    #: per tensor: entry ``i`` maps each GPU UUID to the rebuild's arguments of
    #: ``names[i]``; packed: one entry, the buffer's
    entries: tuple[dict[str, tuple[Any, ...]], ...]
    #: packed: each tensor's bytes in the buffer, in order
    byte_sizes: tuple[int, ...] = ()


def read_handles(update: IpcUpdate) -> ReadHandles:
    """Read and check ``update``'s handles, opening none (see the module's doc); a
    fault is a :class:`~kvrunner.weight_sync.WeightSyncError` naming the field."""
    specs = update.specs()
    handles = unpickle_ipc_handles(update.handles_pickled, what="ipc_handles_pickled")
    if isinstance(handles, Mapping):
        packed = True
    elif isinstance(handles, (list, tuple)):
        packed = False
    else:
        raise WeightSyncError(f"ipc_handles holds a {type(handles).__name__}: a list of "
                              f"{{gpu_uuid: handle}} (one per tensor) or one {{gpu_uuid: "
                              f"handle}} (packed) is read")
    if update.packed is not None and update.packed != packed:
        raise WeightSyncError(
            f"update_info.packed is {str(update.packed).lower()}, but ipc_handles holds "
            + ("one handle dict (the packed form)" if packed else "a list (one handle per "
               "tensor)"))
    if not packed:
        if len(handles) != len(specs):
            raise WeightSyncError(f"ipc_handles has {len(handles)} entries for "
                                  f"{len(specs)} names")
        entries = []
        for i, (spec, entry) in enumerate(zip(specs, handles, strict=True)):
            where = f"ipc_handles[{i}] ({spec.name!r})"
            by_gpu = _by_gpu(entry, where)
            for uuid, args in by_gpu.items():
                _check_announced(args, spec, f"{where} for GPU {uuid}")
            entries.append(by_gpu)
        return ReadHandles(False, tuple(entries))
    by_gpu = _by_gpu(handles, "ipc_handles")
    sizes = _packed_sizes(update, specs)
    element_dtype = _element_dtype(update, specs)
    for uuid, args in by_gpu.items():
        _check_buffer(args, sum(sizes), f"ipc_handles for GPU {uuid}", element_dtype)
    return ReadHandles(True, (by_gpu,), sizes)


def gpu_uuid(device: torch.device) -> str | None:
    """The UUID of ``device``'s GPU as vLLM's senders key it (``str`` of torch's
    device properties' ``uuid``); None off CUDA."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def own_handle(by_gpu: Mapping[str, tuple[Any, ...]], uuid: str | None, device: str,
               where: str) -> tuple[Any, ...]:
    """The arguments ``by_gpu`` holds for the GPU ``uuid`` (the rank's own, on
    ``device``); a handle for another GPU, or a rank off CUDA, is refused naming the
    UUIDs on both sides."""
    offered = ", ".join(sorted(by_gpu))
    if uuid is None:
        raise WeightSyncError(
            f"{where}: this engine rank runs on {device}, which has no GPU UUID, and CUDA "
            f"IPC handles open only on the GPU that holds the memory; the handle is for "
            f"GPU {offered}; nothing of this update was loaded")
    if uuid not in by_gpu:
        raise WeightSyncError(
            f"{where}: no handle for this engine rank's GPU {uuid} ({device}); the handle "
            f"is for GPU {offered}: the trainer's tensors must live on the engine's GPU "
            f"(colocated); nothing of this update was loaded")
    return by_gpu[uuid]


def open_handles(update: IpcUpdate, device: torch.device, *, check_finite: bool,
                 mappings: IpcMappings) -> list[tuple[str, torch.Tensor]]:
    """The announced tensors, opened on ``device`` from the handles of its own GPU
    through ``mappings`` (views of the trainer's memory, held there while the update's
    calls name them: load them, then release the mappings at its end), every value
    checked as a pushed list is (floating point; with ``check_finite`` no NaN or
    inf: one pass over all, then tensor by tensor only to name the culprit)."""
    read = read_handles(update)
    uuid = gpu_uuid(device)
    if not read.packed:
        pairs = []
        for i, (name, by_gpu) in enumerate(zip(update.names, read.entries, strict=True)):
            where = f"ipc_handles[{i}] ({name!r})"
            args = own_handle(by_gpu, uuid, str(device), where)
            pairs.append((name, mappings.open(args, device, where)))
    else:
        args = own_handle(read.entries[0], uuid, str(device), "ipc_handles")
        buffer = mappings.open(args, device, "ipc_handles").view(torch.uint8)
        pairs = _unpacked(buffer, update, read.byte_sizes)
    mappings.keep_only_named()  # an earlier call's buffer this one does not name
    if check_finite:
        check_finite = not all_finite([t for _, t in pairs])
    for name, tensor in pairs:
        problem = tensor_problem(tensor, check_finite=check_finite)
        if problem is not None:
            raise WeightSyncError(f"tensor {name!r} {problem}; nothing of this update "
                                  f"was loaded")
    return pairs


def _by_gpu(entry: Any, where: str) -> dict[str, tuple[Any, ...]]:
    """A ``{gpu_uuid: handle}`` dict's arguments, each handle checked."""
    if not isinstance(entry, Mapping) or not entry:
        raise WeightSyncError(f"{where} is {type(entry).__name__} {_short(entry)}, not a "
                              f"{{gpu_uuid: handle}} dict with at least one GPU")
    out = {}
    for uuid, handle in entry.items():
        if not isinstance(uuid, str):
            raise WeightSyncError(f"{where}: a GPU UUID is {type(uuid).__name__} "
                                  f"{_short(uuid)}, not text")
        out[uuid] = _rebuild_args(handle, f"{where} for GPU {uuid}")
    return out


def _rebuild_args(handle: Any, where: str) -> tuple[Any, ...]:
    """torch's rebuild arguments from a handle (``(rebuild_cuda_tensor, args)`` or
    ``args``), each checked by type, the class tokens resolved to their classes."""
    if isinstance(handle, (tuple, list)) and len(handle) == 2:
        func, handle = handle
        if func is not CUDA_IPC_REBUILD:
            raise WeightSyncError(f"{where}: the handle's function is {func!r}, not torch's "
                                  f"rebuild_cuda_tensor")
    if not isinstance(handle, (tuple, list)) or len(handle) != _NUM_ARGS:
        count = len(handle) if isinstance(handle, (tuple, list)) else type(handle).__name__
        raise WeightSyncError(f"{where}: a handle is torch's {_NUM_ARGS} rebuild_cuda_tensor "
                              f"arguments (what reduce_tensor gives), got {count}")
    args = [a.target if isinstance(a, IpcGlobal) else a for a in handle]
    (tensor_cls, size, stride, offset, storage_cls, dtype, device, storage_handle,
     storage_bytes, storage_offset, requires_grad, ref_handle, ref_offset, event_handle,
     event_sync) = args
    checks = (
        ("tensor class", tensor_cls, tensor_cls in _TENSOR_CLASSES),
        ("size", size, _ints(size)), ("stride", stride, _ints(stride)),
        ("storage offset", offset, _int(offset)),
        ("storage class", storage_cls, storage_cls in _STORAGE_CLASSES),
        ("dtype", dtype, isinstance(dtype, torch.dtype)),
        ("device", device, _int(device)),
        ("storage handle", storage_handle, isinstance(storage_handle, bytes)),
        ("storage bytes", storage_bytes, _int(storage_bytes)),
        ("storage byte offset", storage_offset, _int(storage_offset)),
        ("requires_grad", requires_grad, isinstance(requires_grad, bool)),
        ("ref counter handle", ref_handle, isinstance(ref_handle, bytes)),
        ("ref counter offset", ref_offset, _int(ref_offset)),
        ("event handle", event_handle, event_handle is None or isinstance(event_handle, bytes)),
        ("event_sync_required", event_sync, isinstance(event_sync, bool)),
    )
    for what, value, good in checks:
        if not good:
            shown = repr(value) if isinstance(value, type) else (
                f"{type(value).__name__} {_short(value)}")
            raise WeightSyncError(f"{where}: the handle's {what} is {shown}")
    if len(size) != len(stride):
        raise WeightSyncError(f"{where}: the handle's size {list(size)} and stride "
                              f"{list(stride)} differ in length")
    if math.prod(size):
        end = (offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) + 1)
        if end * dtype.itemsize > storage_bytes:
            raise WeightSyncError(
                f"{where}: the tensor ({dtype} {list(size)}, stride {list(stride)}, offset "
                f"{offset}) runs past its storage of {storage_bytes} bytes")
    return tuple(args)


def _check_announced(args: tuple[Any, ...], spec: TensorSpec, where: str) -> None:
    size, dtype = tuple(args[1]), args[5]
    if size != spec.shape or dtype != DTYPES[spec.dtype]:
        raise WeightSyncError(
            f"{where}: the handle holds a {str(dtype).removeprefix('torch.')} {list(size)} "
            f"tensor, but update_info announces {spec.dtype} {list(spec.shape)}; nothing of "
            f"this update was loaded")


def _packed_sizes(update: IpcUpdate, specs: list[TensorSpec]) -> tuple[int, ...]:
    """The packed tensors' byte counts, each equal to what its dtype and shape need
    (given in bytes, ``tensor_sizes``, or in elements, ``sizes``)."""
    if update.element_sizes is not None:
        field, given, unit = "sizes", update.element_sizes, "elements"
    elif update.tensor_sizes is not None:
        field, given, unit = "tensor_sizes", update.tensor_sizes, "bytes"
    else:
        raise WeightSyncError("ipc_handles holds one handle dict (the packed form), which "
                              "needs update_info.tensor_sizes (each tensor's bytes in the "
                              "buffer) or sizes (its elements)")
    out = []
    for i, (spec, size) in enumerate(zip(specs, given, strict=True)):
        itemsize = DTYPES[spec.dtype].itemsize
        need = math.prod(spec.shape) * (itemsize if unit == "bytes" else 1)
        if size != need:
            raise WeightSyncError(f"{field}[{i}] ({spec.name!r}) is {size} {unit}, but "
                                  f"{spec.dtype} {list(spec.shape)} is {need}")
        out.append(size if unit == "bytes" else size * itemsize)
    return tuple(out)


def _element_dtype(update: IpcUpdate, specs: list[TensorSpec]) -> torch.dtype | None:
    """The one dtype of a buffer packed by elements (None: packed by bytes); every
    announced tensor must be of it, since the sizes count its elements."""
    if update.element_sizes is None or not specs:
        return None
    dtypes = sorted({spec.dtype for spec in specs})
    if len(dtypes) > 1:
        raise WeightSyncError(f"update_info.sizes counts elements of one dtype, but "
                              f"dtype_names holds {dtypes}: a buffer packed by elements "
                              f"holds tensors of one dtype")
    return DTYPES[dtypes[0]]


def _check_buffer(args: tuple[Any, ...], content: int, where: str,
                  element_dtype: torch.dtype | None) -> None:
    """A packed buffer's handle: flat, of ``uint8`` (by bytes) or of the tensors' one
    dtype (by elements), and long enough for ``content`` bytes."""
    size, dtype = tuple(args[1]), args[5]
    held = f"{str(dtype).removeprefix('torch.')} {list(size)}"
    if element_dtype is None:
        if dtype != torch.uint8 or len(size) != 1:
            raise WeightSyncError(f"{where}: a packed buffer is a flat uint8 tensor, the "
                                  f"handle holds {held}")
        if size[0] < content:
            raise WeightSyncError(f"{where}: tensor_sizes add up to {content} bytes, but "
                                  f"the buffer holds {size[0]}")
        return
    name = str(element_dtype).removeprefix("torch.")
    if dtype != element_dtype or len(size) != 1:
        raise WeightSyncError(f"{where}: a buffer packed by elements (sizes) is a flat "
                              f"{name} tensor, as dtype_names announce; the handle holds "
                              f"{held}")
    if size[0] * dtype.itemsize < content:
        raise WeightSyncError(f"{where}: sizes add up to {content // dtype.itemsize} "
                              f"elements, but the buffer holds {size[0]}")


def _unpacked(buffer: torch.Tensor, update: IpcUpdate, byte_sizes: tuple[int, ...],
              ) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a packed buffer (its bytes): views, or copies where a tensor's
    bytes start off its dtype's alignment (vLLM packs without padding)."""
    pairs, start = [], 0
    for name, dtype_name, shape, size in zip(update.names, update.dtype_names, update.shapes,
                                             byte_sizes, strict=True):
        dtype = DTYPES[str(dtype_name).removeprefix("torch.")]
        part = buffer[start:start + size]
        if start % dtype.itemsize:
            part = part.clone()
        pairs.append((name, part.view(dtype).view(shape)))
        start += size
    return pairs


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _ints(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and all(_int(v) for v in value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
