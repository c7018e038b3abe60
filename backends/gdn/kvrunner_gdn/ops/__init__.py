"""The GDN layer's ops, one folder per op as flash-linear-attention lays out its own:
``gated_delta_rule`` (the recurrence over the state pool) and ``short_conv`` (the
causal depthwise conv over the conv-state pool). Each folder holds the op's naive
definition, its plain-torch paths and its Triton kernels, every entry taking one typed
inputs record; ``utils`` holds what they share.

The torch paths and the naive definitions never import Triton, so the backend serves
on a machine without it.
"""
