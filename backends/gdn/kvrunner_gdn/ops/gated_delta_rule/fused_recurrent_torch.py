"""The decode recurrence in plain torch (no Triton import: the CPU path).

Vectorised over rows and heads; the contract of :mod:`.fused_recurrent`, not
graph-capturable (it masks on the host).
"""

from __future__ import annotations

import torch

from kvrunner_gdn.ops.gated_delta_rule.inputs import GatedDeltaRuleInputs
from kvrunner_gdn.ops.utils import valid_rows


def fused_recurrent_gated_delta_rule_torch(*, inputs: GatedDeltaRuleInputs) -> torch.Tensor:
    """One token per sequence: ``[B, Hv, V]`` in v's dtype; the pool updated in place."""
    x = inputs
    rows = x.sequences(chunked=False)
    state, read, write = x.state, x.read_indices.long(), x.write_indices.long()
    runs, reads = valid_rows(read, write)
    qf, kf = x.value_head_qk()
    s = torch.zeros(rows, *state.shape[1:], dtype=torch.float32, device=state.device)
    s[reads] = state[read[reads]]
    s = s * torch.exp(x.g.float())[:, :, None, None]
    kv_mem = torch.einsum("bhkv,bhk->bhv", s, kf)
    delta = x.beta.float()[:, :, None] * (x.v.float() - kv_mem)
    s = s + kf[:, :, :, None] * delta[:, :, None, :]
    out = torch.einsum("bhkv,bhk->bhv", s, qf)
    out[~runs] = 0.0
    state[write[runs]] = s[runs]
    return out.to(x.v.dtype)
