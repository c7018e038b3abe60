"""The paged backend's ops, one folder per op as flash-linear-attention lays out its own:
``paged_attention`` (causal attention over the paged KV pool: decode, prefill and
deterministic mode's fixed order) and ``store_kv`` (a step's keys and values written to
their slots). Each folder holds the op's naive definition, its plain-torch paths and
its Triton kernels; ``utils`` holds what they share.

The torch paths and the naive definitions never import Triton, so the backend serves
on a machine without it.
"""
