"""The causal depthwise conv of the GDN layer, one file per way of computing it:

- ``naive``: the token-by-token fp32 definition, for one sequence (the tests' oracle);
- ``update`` / ``update_torch``: decode, one new token per sequence (Triton / torch);
- ``prefill`` / ``prefill_torch``: concatenated sequences (Triton / torch).

Every entry but the oracle is keyword-only and takes one
:class:`~kvrunner_gdn.ops.short_conv.inputs.ShortConvInputs`. The Triton modules are
imported only where Triton runs; nothing here imports them.
"""

from kvrunner_gdn.ops.short_conv.inputs import ShortConvInputs

__all__ = ["ShortConvInputs"]
