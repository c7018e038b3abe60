"""forward_vars: the persistent buffers a step's inputs are copied into.

Captured graphs read these by address, so every buffer is created once at its
largest size and never reallocated; a step copies its rows in and the tail keeps
whatever padding the owner wrote. Sleep does not release them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch


class ForwardVars(Mapping[str, torch.Tensor]):
    """A name -> tensor registry that refuses to replace a buffer once registered."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def register(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name in self._buffers:
            raise KeyError(f"forward_vars already has a buffer named {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"forward_vars[{name!r}] must be a tensor, got {type(tensor).__name__}")
        self._buffers[name] = tensor
        return tensor

    def register_all(self, buffers: Mapping[str, torch.Tensor]) -> None:
        for name, tensor in buffers.items():
            self.register(name, tensor)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._buffers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._buffers)

    def __len__(self) -> int:
        return len(self._buffers)

    def owns(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` shares storage with a registered buffer."""
        ptr = tensor.untyped_storage().data_ptr()
        return any(b.untyped_storage().data_ptr() == ptr for b in self._buffers.values())
