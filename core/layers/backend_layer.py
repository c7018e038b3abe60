"""The handle the model holds for a backend's layer object: failures name their owner.

An exception inside a layer's ``forward`` would otherwise surface as a bare kernel
error, naming neither the backend nor the layer. :class:`BackendLayer` forwards the
call unchanged and re-raises any exception as :class:`BackendLayerError` with both
names, the original chained. Attribute reads (``conv_dim`` and the like) reach the
backend's object directly.
"""

from __future__ import annotations

from typing import Any


class BackendLayerError(RuntimeError):
    """A backend's layer raised during a forward (a bug, not a configuration error)."""


class BackendLayer:
    """A backend's layer object, as ``make_layer`` answered it, with its provenance."""

    __slots__ = ("backend", "impl", "layer_index", "layer_type")

    def __init__(self, impl: Any, *, backend: str, layer_index: int, layer_type: str) -> None:
        self.impl = impl
        self.backend = backend
        self.layer_index = layer_index
        self.layer_type = layer_type

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.impl.forward(*args, **kwargs)
        except BackendLayerError:
            raise
        except Exception as e:
            raise BackendLayerError(
                f"backend {self.backend!r}, layer {self.layer_index} ({self.layer_type}): "
                f"forward raised {type(e).__name__}: {e}"
            ) from e

    __call__ = forward

    def __getattr__(self, name: str) -> Any:
        if name in BackendLayer.__slots__:  # not set yet (unpickling, a failed __init__)
            raise AttributeError(name)
        return getattr(self.impl, name)

    def __repr__(self) -> str:
        return f"BackendLayer({self.backend!r}, layer {self.layer_index}, {self.impl!r})"
