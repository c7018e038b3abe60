"""The FP8 scales of the paged pools: one ``[4, num_kv_heads]`` table per served layer
(:func:`~kvrunner_paged.kv_format.scale_table`'s rows), in one device tensor the
backend owns.

Where they come from, as in vLLM:

* 1.0 on every head, unless something below sets them;
* a checkpoint or a weight update carrying the layer's ``k_scale`` / ``v_scale`` (per
  tensor, or one per KV head; the model maps the names, :meth:`KVScales.load`);
* with ``calculate_kv_scales``, the layer's first real prefill: ``amax(|k|) / 200`` and
  ``amax(|v|) / 100`` per tensor (vLLM's ``K_SCALE_CONSTANT`` and ``V_SCALE_CONSTANT``:
  the first batch's largest key lands at 200 of e4m3's 448, leaving later batches room),
  at least :data:`MIN_SCALE`, 1.0 where the batch gives no finite positive maximum. A
  layer whose scales were loaded is not calibrated over them.

Every write is in place: a captured graph reads the table by address, so a replay
after an update or a calibration uses the new scales. The table is not a pool: a sleep
releases the pools and leaves it, so the scales survive sleep and wake.
"""

from __future__ import annotations

import torch

from kvrunner_paged.kv_format import K_INV, K_SCALE, V_INV, V_SCALE, checked_scale, scale_table

#: what ``calculate_kv_scales`` divides a first prefill's largest key by (vLLM's
#: ``K_SCALE_CONSTANT``)
K_RANGE = 200.0
#: likewise its largest value (vLLM's ``V_SCALE_CONSTANT``)
V_RANGE = 100.0
#: the smallest calibrated scale: a first batch of near-zero keys still leaves a
#: scale whose reciprocal is finite
MIN_SCALE = 2.0**-24

_ROWS = {"k": (K_SCALE, K_INV), "v": (V_SCALE, V_INV)}


class KVScales:
    """Every served layer's scale table, and which layers still calibrate."""

    def __init__(self, *, layers: tuple[int, ...], num_kv_heads: int, device: torch.device,
                 calculate: bool) -> None:
        self.num_kv_heads = num_kv_heads
        self._row = {layer: i for i, layer in enumerate(layers)}
        #: ``[layers, 4, num_kv_heads]`` float32; rewritten in place, never replaced
        self.table = scale_table(1.0, 1.0, num_kv_heads).repeat(len(layers), 1, 1).to(device)
        #: layers whose next real prefill sets their scales
        self.uncalibrated: set[int] = set(layers) if calculate else set()

    def of(self, layer: int) -> torch.Tensor:
        """``layer``'s ``[4, num_kv_heads]`` table (a view: it sees every later write)."""
        return self.table[self._row[layer]]

    def check(self, which: str, scale: torch.Tensor) -> None:
        """Refuse a scale :meth:`load` would refuse by its shape alone (a dry run's meta
        tensors carry no values): ``ValueError`` naming the problem."""
        if which not in _ROWS:
            raise ValueError(f"a KV scale is 'k' or 'v', not {which!r}")
        if scale.numel() != 1 and tuple(scale.shape) != (self.num_kv_heads,):
            raise ValueError(f"{which}_scale must be one number or one per KV head "
                             f"({self.num_kv_heads} here), got shape {tuple(scale.shape)}")

    def load(self, layer: int, which: str, scale: torch.Tensor) -> None:
        """Set ``layer``'s key (``which="k"``) or value scales, per tensor (one element)
        or per KV head, in place; the layer no longer calibrates. A scale that is not
        positive and finite raises ``ValueError`` and changes nothing."""
        self.check(which, scale)
        heads = checked_scale(scale, self.num_kv_heads, f"{which}_scale")
        scale_row, inverse_row = _ROWS[which]
        table = self.of(layer)
        table[scale_row].copy_(heads)
        table[inverse_row].copy_(heads.reciprocal())
        self.uncalibrated.discard(layer)

    def calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Set ``layer``'s scales from this prefill's keys and values (``[tokens,
        num_kv_heads, head_dim]``, real rows only), on the device: no host read."""
        table = self.of(layer)
        for rows, bound, (scale_row, inverse_row) in ((k, K_RANGE, _ROWS["k"]),
                                                      (v, V_RANGE, _ROWS["v"])):
            amax = rows.abs().amax().float()
            usable = torch.isfinite(amax) & (amax > 0)
            scale = torch.where(usable, (amax / bound).clamp(min=MIN_SCALE), 1.0)
            table[scale_row].copy_(scale.expand(self.num_kv_heads))
            table[inverse_row].copy_(scale.reciprocal().expand(self.num_kv_heads))
        self.uncalibrated.discard(layer)
