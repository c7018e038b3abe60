"""The gated delta rule, one file per way of computing it (fla's layout):

- ``naive``: the token-by-token fp32 definition, for one sequence (the tests' oracle);
- ``fused_recurrent`` / ``fused_recurrent_torch``: decode, one token per sequence
  (Triton / plain torch);
- ``chunk`` / ``chunk_torch``: the chunked prefill over concatenated sequences
  (Triton / plain torch), ``chunk_fla`` the same through flash-linear-attention.

Every entry but the oracle is keyword-only and takes one
:class:`~kvrunner_gdn.ops.gated_delta_rule.inputs.GatedDeltaRuleInputs`. The Triton
modules are imported only where Triton runs; nothing here imports them.
"""

from kvrunner_gdn.ops.gated_delta_rule.inputs import GatedDeltaRuleInputs

__all__ = ["GatedDeltaRuleInputs"]
