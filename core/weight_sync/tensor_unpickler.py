"""A pickle reader that rebuilds tensors and nothing else.

SGLang's ``/update_weights_from_tensor`` carries pickles (``MultiprocessingSerializer``:
``ForkingPickler`` output, base64 text). A pickle is a program: a ``REDUCE`` may call
any importable function (``os.system``). :class:`TensorUnpickler` resolves only the
globals a tensor payload needs and refuses every other one by its dotted name, before
anything is called:

* torch's tensor rebuilds: ``torch.multiprocessing.reductions`` (a CPU storage shared
  by file name, ``torch.multiprocessing.set_sharing_strategy("file_system")``; an
  empty storage; a CUDA tensor by IPC handle), and plain ``pickle`` of a tensor
  (``torch._utils._rebuild_tensor_v2``, its storage as ``torch.save`` bytes, read
  back with ``torch.load(weights_only=True)``, never torch's own
  ``_load_from_bytes``, which would load any object);
* the classes and values those calls take: ``torch.Tensor``, ``Parameter``,
  ``torch.Size``, storage classes, dtypes, ``collections.OrderedDict``;
* SGLang's ``FlattenedTensorMetadata``, read into :class:`BucketEntry` (a record
  of checked plain fields; SGLang need not be installed);
* SGLang's patched CUDA rebuild, which names the device by UUID, resolved here to
  the local device index before torch's rebuild runs.

A CPU storage shared by file descriptor (torch's default strategy) is refused by
name: the descriptor can only be fetched by a process of the sender's own tree.

vLLM's IPC weight transfer (``ipc_handles_pickled``) carries no tensors but the
*arguments* of torch's CUDA rebuild, keyed by GPU UUID, for the engine to call
itself once it has found its own GPU's entry. :class:`IpcHandleUnpickler` reads
them with a narrower list: torch's ``rebuild_cuda_tensor`` and the tensor and
storage classes its arguments name, each resolved to an :class:`IpcGlobal` token
that refuses to be called (so the pickle can neither open a handle nor allocate
while it is read), the dtypes, and ``torch.Size``. Nothing else, not even the
other tensor rebuilds.
"""

from __future__ import annotations

import base64
import binascii
import collections
import io
import pickle
from typing import Any

import torch
import torch.multiprocessing.reductions as reductions

from kvrunner.weight_sync.errors import WeightSyncError

#: the fields of SGLang's FlattenedTensorMetadata and the types each must have
_ENTRY_FIELDS: dict[str, type | tuple[type, ...]] = {
    "name": str, "shape": (torch.Size, tuple, list), "dtype": torch.dtype,
    "start_idx": int, "end_idx": int, "numel": int,
}

#: where SGLang has defined FlattenedTensorMetadata (slime imports it from either)
_ENTRY_MODULES = ("sglang.srt.weight_sync.tensor_bucket", "sglang.srt.model_executor.model_runner")

#: where SGLang's CUDA rebuild (the device named by UUID) has lived
_SGLANG_CUDA_REBUILD = ("sglang.srt.utils.patch_torch", "sglang.srt.patch_torch")


class BucketEntry:
    """One tensor of a flattened bucket, as SGLang's ``FlattenedTensorMetadata``
    names it: ``name``, ``shape``, ``dtype``, ``start_idx``, ``end_idx``, ``numel``.
    Filled by the pickle's state (``__setstate__``), which must hold exactly those
    fields with those types."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int

    def __setstate__(self, state: Any) -> None:
        """Take the pickled fields, refusing a missing, extra or mistyped one."""
        if not isinstance(state, dict) or set(state) != set(_ENTRY_FIELDS):
            keys = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise WeightSyncError(f"a FlattenedTensorMetadata holds {keys}, not the fields "
                                  f"{sorted(_ENTRY_FIELDS)}")
        for field, kind in _ENTRY_FIELDS.items():
            value = state[field]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise WeightSyncError(f"FlattenedTensorMetadata.{field} is "
                                      f"{type(value).__name__} {value!r}")
        self.__dict__.update(state, shape=tuple(int(d) for d in state["shape"]))

    def __repr__(self) -> str:
        return (f"BucketEntry({self.name!r}, {self.shape}, {self.dtype}, "
                f"[{self.start_idx}:{self.end_idx}])")


def _storage_from_bytes(data: bytes) -> Any:
    """A storage saved by ``torch.save`` (plain pickle of a tensor), loaded as weights
    only: torch's ``_load_from_bytes`` would load any object."""
    if not isinstance(data, bytes):
        raise WeightSyncError(f"a pickled storage holds {type(data).__name__}, not bytes")
    return torch.load(io.BytesIO(data), weights_only=True)


_FD_REFUSED = (
    "a CPU tensor was shared by file descriptor (torch's default sharing strategy), which "
    "only a process of the sender's own tree can open: share it by file name, "
    "torch.multiprocessing.set_sharing_strategy('file_system'), before serializing")

#: the globals of a storage shared by file descriptor, refused with the fix
_FD_GLOBALS = {("torch.multiprocessing.reductions", "rebuild_storage_fd"),
               ("multiprocessing.resource_sharer", "DupFd")}


def _cuda_tensor_by_uuid(*args: Any) -> torch.Tensor:
    """SGLang's CUDA rebuild: torch's, with the device (argument 6) given as the GPU's
    UUID, which names the same GPU in processes that number devices differently."""
    device = args[6] if len(args) > 6 else None
    if isinstance(device, str):
        matches = [i for i in range(torch.cuda.device_count())
                   if str(torch.cuda.get_device_properties(i).uuid) == device]
        if not matches:
            raise WeightSyncError(f"no visible GPU has the UUID {device} the tensor names")
        args = (*args[:6], matches[0], *args[7:])
    return reductions.rebuild_cuda_tensor(*args)


def _torch_globals() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {
        ("torch", "Tensor"): torch.Tensor,
        ("torch", "Size"): torch.Size,
        ("torch", "UntypedStorage"): torch.UntypedStorage,
        ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
        ("torch.storage", "TypedStorage"): torch.TypedStorage,
        ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
        ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
        ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
        ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _cuda_tensor_by_uuid,
    }
    for name in ("rebuild_tensor", "rebuild_typed_storage", "rebuild_storage_filename",
                 "rebuild_storage_empty"):
        allowed["torch.multiprocessing.reductions", name] = getattr(reductions, name)
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            allowed["torch", name] = value
        elif name.endswith("Storage") and isinstance(value, type):
            allowed["torch", name] = value  # typed storage classes (FloatStorage, ...)
    for module in _ENTRY_MODULES:
        allowed[module, "FlattenedTensorMetadata"] = BucketEntry
    for module in _SGLANG_CUDA_REBUILD:
        allowed[module, "_rebuild_cuda_tensor_modified"] = _cuda_tensor_by_uuid
    return allowed


_ALLOWED = _torch_globals()


class TensorUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` resolving only the globals of a tensor payload (above)."""

    #: the globals this reader resolves, by (module, name)
    allowed: dict[tuple[str, str], Any] = _ALLOWED
    #: what a refusal says this reader reads
    reads = "only torch's tensor and storage rebuilds are read"

    def find_class(self, module: str, name: str) -> Any:
        """The allowed global ``module.name``; any other is refused by name."""
        found = self.allowed.get((module, name))
        if found is None and (module, name) in _FD_GLOBALS:
            raise WeightSyncError(_FD_REFUSED)
        if found is None:
            raise WeightSyncError(
                f"the payload's pickle calls {module}.{name}, which is not a tensor rebuild: "
                f"refused ({self.reads})")
        return found

    def persistent_load(self, pid: Any) -> Any:
        """A payload pickle has no persistent ids (those are ``torch.save``'s, read by
        ``torch.load``)."""
        raise WeightSyncError("the payload's pickle holds a persistent id: refused")


class IpcGlobal:
    """A global a pickle of vLLM's IPC handles names (torch's ``rebuild_cuda_tensor``,
    a tensor or storage class), read as a token of it: a value the engine recognises
    (``target`` is the global itself), never something the pickle may call, so no
    handle is opened and nothing is allocated while the pickle is read."""

    def __init__(self, module: str, name: str, target: Any) -> None:
        self.module, self.name, self.target = module, name, target

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise WeightSyncError(f"the pickle calls {self.module}.{self.name} while it is read: "
                              f"IPC handles are opened by the engine, for its own GPU, never "
                              f"by the payload")

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"


#: what ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` unpickles to in
#: :class:`IpcHandleUnpickler`
CUDA_IPC_REBUILD = IpcGlobal("torch.multiprocessing.reductions", "rebuild_cuda_tensor",
                             reductions.rebuild_cuda_tensor)


def _ipc_globals() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): CUDA_IPC_REBUILD,
        ("torch", "Size"): torch.Size,  # a tuple of ints: calling it is harmless
    }
    for module, name, target in (
        ("torch", "Tensor", torch.Tensor),
        ("torch.nn.parameter", "Parameter", torch.nn.Parameter),
        ("torch.storage", "TypedStorage", torch.TypedStorage),
        ("torch.storage", "UntypedStorage", torch.UntypedStorage),
    ):
        allowed[module, name] = IpcGlobal(module, name, target)
    for name in dir(torch):
        if isinstance(getattr(torch, name, None), torch.dtype):
            allowed["torch", name] = getattr(torch, name)
    return allowed


class IpcHandleUnpickler(TensorUnpickler):
    """Reads vLLM's pickled IPC handles: torch's CUDA rebuild as
    :data:`CUDA_IPC_REBUILD`, the classes and dtypes of its arguments, and nothing
    else."""

    allowed = _ipc_globals()
    reads = "only torch's rebuild_cuda_tensor and the classes its arguments name are read"


def unpickle_ipc_handles(data: str | bytes, *, what: str) -> Any:
    """The object vLLM's ``ipc_handles_pickled`` (base64 text or bytes) holds, read by
    :class:`IpcHandleUnpickler`: nothing is called but the constructors of
    ``torch.Size`` and the like, and no handle is opened. Any fault is a
    :class:`~kvrunner.weight_sync.WeightSyncError` naming ``what``."""
    return _read(data, what, IpcHandleUnpickler)


def unpickle_tensors(data: str | bytes, *, what: str) -> Any:
    """The object a ``MultiprocessingSerializer`` payload (base64 text or bytes)
    holds, read by :class:`TensorUnpickler`; any fault is a
    :class:`~kvrunner.weight_sync.WeightSyncError` that names ``what``."""
    return _read(data, what, TensorUnpickler)


def _read(data: str | bytes, what: str, reader: type[TensorUnpickler]) -> Any:
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise WeightSyncError(f"{what} is not base64: {e}") from None
    try:
        return reader(io.BytesIO(data)).load()
    except WeightSyncError as e:
        raise WeightSyncError(f"{what}: {e}") from None
    except Exception as e:  # a truncated or malformed pickle, a rebuild that failed
        raise WeightSyncError(f"{what} cannot be read as a tensor payload: "
                              f"{type(e).__name__}: {e}") from None
