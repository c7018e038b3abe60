"""``update_info`` bodies of vLLM's IPC weight transfer and SkyRL's IPC chunks, built
as their senders build them, for the CPU tests: the handles are the arguments torch's
``reduce_tensor`` gives a CUDA tensor, with stand-in IPC handle bytes (no CPU can make
or open a real one), so everything but opening them is exercised. The GPU tests
(test_ipc_handles_gpu.py, test_skyrl_ipc_gpu.py) make real ones in a trainer process."""

from __future__ import annotations

import base64
import math
import pickle
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

#: a GPU UUID as ``str(torch.cuda.get_device_properties(i).uuid)`` spells one
TRAINER_GPU = "6f1b3c2e-9a7d-4e55-8c1f-0d2a3b4c5d6e"
OTHER_GPU = "0a0b0c0d-1111-2222-3333-444455556666"


def cuda_args(shape: list[int], dtype: torch.dtype) -> tuple[Any, ...]:
    """What ``reduce_tensor(t)[1]`` holds for a contiguous CUDA tensor ``t`` of
    ``shape`` and ``dtype`` alone in its storage (the handles stand-ins)."""
    stride = torch.empty(shape, device="meta").stride()
    nbytes = math.prod(shape) * dtype.itemsize
    return (torch.Tensor, torch.Size(shape), stride, 0, torch.storage.TypedStorage, dtype, 0,
            b"\x11" * 64, nbytes, 0, False, b"\x22" * 64, 0, b"\x33" * 64, True)


def b64(obj: Any) -> str:
    """What vLLM's HTTP client sends: base64 of the pickle."""
    return base64.b64encode(pickle.dumps(obj)).decode()


def per_tensor(specs: list[tuple[str, str, list[int]]], *, with_function: bool = True,
               gpu: str = TRAINER_GPU) -> dict[str, Any]:
    """One handle per tensor: ``{gpu: (rebuild_cuda_tensor, args)}`` (vLLM's first
    trainer_send_weights, SkyRL) or ``{gpu: args}`` (vLLM's trainer engine)."""
    handles = []
    for _name, dtype, shape in specs:
        args = cuda_args(shape, getattr(torch, dtype))
        handles.append({gpu: (rebuild_cuda_tensor, args) if with_function else args})
    return {"names": [n for n, _, _ in specs], "dtype_names": [d for _, d, _ in specs],
            "shapes": [s for _, _, s in specs], "ipc_handles_pickled": b64(handles)}


def packed(specs: list[tuple[str, str, list[int]]], *, buffer_bytes: int | None = None,
           gpu: str = TRAINER_GPU) -> dict[str, Any]:
    """One handle for a flat uint8 buffer holding the tensors back to back, with each
    one's bytes in ``tensor_sizes`` (vLLM's packed_ipc_producer)."""
    sizes = [math.prod(shape) * getattr(torch, dtype).itemsize for _, dtype, shape in specs]
    buffer = cuda_args([buffer_bytes or sum(sizes)], torch.uint8)
    return {"names": [n for n, _, _ in specs], "dtype_names": [d for _, d, _ in specs],
            "shapes": [s for _, _, s in specs], "tensor_sizes": sizes,
            "ipc_handles_pickled": b64({gpu: buffer})}


def skyrl_packed(specs: list[tuple[str, str, list[int]]], *, buffer_elements: int | None = None,
                 gpu: str = TRAINER_GPU) -> dict[str, Any]:
    """SkyRL's ``update_weights_ipc`` chunk (``CudaIpcWeightTransferSender``): one
    ``{gpu: (rebuild_cuda_tensor, args)}`` for a flat buffer of the chunk's one dtype,
    each tensor's element count in ``sizes``."""
    sizes = [math.prod(shape) for _, _, shape in specs]
    dtype = getattr(torch, specs[0][1])
    buffer = cuda_args([buffer_elements or sum(sizes)], dtype)
    return {"names": [n for n, _, _ in specs], "dtype_names": [d for _, d, _ in specs],
            "shapes": [s for _, _, s in specs], "sizes": sizes,
            "ipc_handles_pickled": b64({gpu: (rebuild_cuda_tensor, buffer)})}
