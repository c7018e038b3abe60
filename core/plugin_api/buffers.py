"""In-place fills of persistent buffers and host values sent to the device without a
wait, shared by the core and the backends."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def fill_head(buffer: torch.Tensor, values: torch.Tensor, pad: int) -> None:
    """Copy ``values`` into the first rows of ``buffer`` and ``pad`` into the rest.

    The tail matters as much as the head: a row a previous (longer) step left there
    would otherwise still point at a live cache row.
    """
    n = values.shape[0]
    if n > buffer.shape[0]:
        raise ValueError(f"{n} rows do not fit a buffer of {buffer.shape[0]}")
    buffer[:n].copy_(values, non_blocking=True)
    buffer[n:].fill_(pad)


def on_device(values: Sequence[Any] | np.ndarray, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device`` without making the host wait for the device:
    through pinned memory and a non-blocking copy on CUDA (a plain ``torch.tensor(...,
    device=cuda)`` waits for every queued kernel, i.e. for the step still running)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def upload_into(target: torch.Tensor, values: Sequence[Any] | np.ndarray) -> None:
    """Copy the host ``values`` (nested lists of ``target``'s shape) into ``target``, a
    device buffer or a view of one, without making the host wait: through pinned
    memory on CUDA (torch's pinned cache keeps the block until the copy has run, so
    the host may fill another for the next step at once)."""
    host = torch.tensor(values, dtype=target.dtype)
    if host.shape != target.shape:  # copy_ would broadcast a smaller one silently
        raise ValueError(f"values of shape {tuple(host.shape)} for a target of "
                         f"{tuple(target.shape)}")
    if target.device.type == "cuda":
        host = host.pin_memory()
    target.copy_(host, non_blocking=True)
