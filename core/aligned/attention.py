"""The trainer's causal attention on the engine's fixed-order attention.

In deterministic mode the paged backend attends every token in one order (its
sequence's keys from position 0 in fixed tiles and splits), so a token gets the same
bits in a prompt, a prefill chunk or a decode step
(``kvrunner_paged/ops/paged_attention/fixed_order_torch.py`` and ``fixed_order.py``).
Here the trainer's sequences are laid into a paged pool of their own (each sequence's
keys in consecutive blocks) and the backend's very entry attends them: the torch
path, or the Triton kernel where the engine's layers launch Triton.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrunner.aligned.engine_op import engine_op
from kvrunner.aligned.rules import AlignmentError
from kvrunner.layers.fused.dispatch import use_triton

#: positions a pool block holds (any size attends alike: the keys are read by position)
POOL_BLOCK = 16


def _paged_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                  scale: float):
    """The backend's inputs record for sequences of ``lengths`` tokens laid end to end
    in ``q``/``k``/``v``, every sequence's keys stored in a pool of its own blocks."""
    from kvrunner_paged.ops.paged_attention.inputs import PagedAttentionInputs

    device = q.device
    blocks = [-(-n // POOL_BLOCK) for n in lengths]
    first_block = torch.tensor([0, *blocks], device=device).cumsum(0)
    starts = torch.tensor([0, *lengths], device=device).cumsum(0)
    seq_of_token = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                           torch.tensor(lengths, device=device))
    offset = torch.arange(q.shape[0], device=device) - starts[seq_of_token]
    slots = first_block[seq_of_token] * POOL_BLOCK + offset
    total = int(first_block[-1]) * POOL_BLOCK
    pools = []
    for x in (k, v):
        pool = x.new_zeros(total, *x.shape[1:])
        pool[slots] = x
        pools.append(pool.view(-1, POOL_BLOCK, *x.shape[1:]))
    widest = max(blocks)
    tables = (first_block[:-1, None] + torch.arange(widest, device=device)[None, :])
    tables = tables.clamp(max=int(first_block[-1]) - 1).to(torch.int32)
    return PagedAttentionInputs(
        q=q.contiguous(), k_cache=pools[0], v_cache=pools[1], block_tables=tables,
        context_lens=torch.tensor(lengths, dtype=torch.int32, device=device), scale=scale,
        query_start_loc=starts.to(torch.int32), num_seqs=len(lengths),
        max_query_len=max(lengths),
    )


def fixed_order_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          lengths: list[int], scale: float) -> torch.Tensor:
    """The paged backend's deterministic entry over these sequences (no autograd)."""
    try:
        import kvrunner_paged  # noqa: F401
    except ImportError:
        raise AlignmentError("aligned attention runs the paged backend's fixed-order "
                             "attention; install backends/paged (kvrunner-paged)") from None
    inputs = _paged_inputs(q, k, v, lengths, scale)
    if use_triton(q):
        from kvrunner_paged.ops.paged_attention.fixed_order import (
            fixed_order_attention as fixed_order_triton,
        )

        return fixed_order_triton(inputs=inputs, max_context_len=max(lengths))
    from kvrunner_paged.ops.paged_attention.fixed_order_torch import fixed_order_attention_torch

    return fixed_order_attention_torch(inputs=inputs)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        lengths: list[int], scale: float,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Causal attention of each sequence by SDPA in ``dtype`` (differentiable), returned
    in q's dtype."""
    group = q.shape[1] // k.shape[1]
    outs = []
    for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
        # [heads, tokens, dim]
        qs = qs.to(dtype).transpose(0, 1)
        ks = ks.to(dtype).repeat_interleave(group, dim=1).transpose(0, 1)
        vs = vs.to(dtype).repeat_interleave(group, dim=1).transpose(0, 1)
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs).to(q.dtype)


def aligned_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                      scale: float) -> torch.Tensor:
    """Causal attention of sequences laid end to end (``q`` ``[T, Hq, D]``, ``k`` and
    ``v`` ``[T, Hk, D]``, ``lengths`` summing to ``T``), each token attended as the
    engine attends it in deterministic mode; the gradient of float32 causal
    attention."""
    return engine_op(lambda q, k, v: fixed_order_attention(q, k, v, lengths, scale),
                     lambda q, k, v: attention_reference(q, k, v, lengths, scale), q, k, v)
