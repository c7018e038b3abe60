"""The per-request state pools: one conv state and one recurrent (SSM) state per GDN layer.

Both are float32 and indexed by request slot (``num_slots`` rows), not by KV block:
a GDN layer's memory of a sequence is fixed-size, however long the sequence is.

- conv state ``[num_slots, conv_dim, kernel - 1]``: the previous ``kernel - 1`` conv
  inputs (q, k, v channels concatenated), oldest first;
- recurrent state ``[num_slots, num_value_heads, head_k_dim, head_v_dim]``.

Contents of a slot are meaningful only while a request owns it. A request that
starts at position 0 never reads its slot (the kernels treat its history as zero)
and overwrites it, so neither a fresh allocation nor a wake has to clear anything.
"""

from __future__ import annotations

import attrs
import torch

from kvrunner.plugin_api import ModelSpec

STATE_DTYPE = torch.float32


@attrs.frozen(kw_only=True)
class GDNShapes:
    """The linear-attention shapes of one layer (already divided by tensor parallelism)."""

    num_key_heads: int
    num_value_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @classmethod
    def from_model(cls, model: ModelSpec) -> GDNShapes:
        shapes = cls(
            num_key_heads=model.linear_num_key_heads,
            num_value_heads=model.linear_num_value_heads,
            head_k_dim=model.linear_key_head_dim,
            head_v_dim=model.linear_value_head_dim,
            conv_kernel=model.linear_conv_kernel_dim,
        )
        if min(attrs.astuple(shapes)) <= 0:
            raise ValueError(f"the model has no usable linear-attention shapes: {shapes}")
        if shapes.conv_kernel < 2:
            raise ValueError("linear_conv_kernel_dim must be >= 2 (the conv keeps kernel-1 inputs)")
        if shapes.num_value_heads % shapes.num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({shapes.num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({shapes.num_key_heads})"
            )
        return shapes

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of ``mixed_qkv``: q and k (``key_dim`` each), then v (``value_dim``)."""
        return 2 * self.key_dim + self.value_dim

    def conv_state_shape(self, num_slots: int) -> tuple[int, int, int]:
        return (num_slots, self.conv_dim, self.conv_kernel - 1)

    def ssm_state_shape(self, num_slots: int) -> tuple[int, int, int, int]:
        return (num_slots, self.num_value_heads, self.head_k_dim, self.head_v_dim)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of both states of one layer for one slot."""
        elems = self.conv_dim * (self.conv_kernel - 1)
        elems += self.num_value_heads * self.head_k_dim * self.head_v_dim
        return elems * STATE_DTYPE.itemsize


def cache_rows(pool_name: str, pool: torch.Tensor) -> tuple[str, torch.Tensor]:
    """Every pool is indexed by request slot first (for the conformance kit)."""
    del pool_name
    return "state", pool


class GDNStatePool:
    """The conv and recurrent state tensors of every layer one backend serves."""

    def __init__(self, shapes: GDNShapes, layers: tuple[int, ...], device: torch.device) -> None:
        self.shapes = shapes
        self.layers = layers
        self.device = device
        self._tensors: dict[str, torch.Tensor] = {}

    @property
    def bytes_per_slot(self) -> int:
        return self.shapes.bytes_per_slot * len(self.layers)

    @property
    def allocated(self) -> bool:
        return bool(self._tensors)

    def allocate(self, num_slots: int) -> dict[str, torch.Tensor]:
        """Allocate ``conv.<layer>`` and ``ssm.<layer>`` for every layer; returns them by name.

        Zero-filled so that a capture audit starts from a deterministic pool; the
        kernels never rely on it (see the module docstring).
        """
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        tensors: dict[str, torch.Tensor] = {}
        for layer in self.layers:
            conv = self.shapes.conv_state_shape(num_slots)
            ssm = self.shapes.ssm_state_shape(num_slots)
            tensors[f"conv.{layer}"] = torch.zeros(conv, dtype=STATE_DTYPE, device=self.device)
            tensors[f"ssm.{layer}"] = torch.zeros(ssm, dtype=STATE_DTYPE, device=self.device)
        self._tensors = tensors
        return dict(tensors)

    def release(self) -> None:
        self._tensors = {}

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(conv_state, ssm_state)`` of ``layer``; fails loudly if the pool is not allocated."""
        try:
            return self._tensors[f"conv.{layer}"], self._tensors[f"ssm.{layer}"]
        except KeyError:
            why = "has no such layer" if self.allocated else "is not allocated (released?)"
            raise RuntimeError(f"no GDN state for layer {layer}: the pool {why}") from None
