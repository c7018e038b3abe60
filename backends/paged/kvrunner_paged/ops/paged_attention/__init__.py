"""Causal attention over the paged KV pool, one file per way of computing it (fla's layout):

- ``naive``: the fp32 definition, a loop over sequences and key positions (the tests'
  oracle);
- ``decode`` / ``decode_torch``: one query per row (Triton, split-KV, storing the step's
  keys and values in the same launch / plain torch, one padded SDPA call);
- ``prefill`` / ``prefill_torch``: concatenated sequences after their cached prefixes,
  decode rows among them (Triton / plain torch, one SDPA call a sequence);
- ``fixed_order`` / ``fixed_order_torch``: deterministic mode's attention, every token in
  one order whatever its batch (Triton / plain torch);
- ``tile``: the online-softmax tile loop every Triton kernel here runs.

Every entry but the oracle is keyword-only and takes one
:class:`~kvrunner_paged.ops.paged_attention.inputs.PagedAttentionInputs`. The Triton
modules are imported only where Triton runs; nothing here imports them.
"""

from kvrunner_paged.ops.paged_attention.inputs import PagedAttentionInputs

__all__ = ["PagedAttentionInputs"]
