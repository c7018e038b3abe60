"""Tensor parallelism over torch.distributed (NCCL on GPU, gloo on CPU).

``group`` (process group and the layers' collectives), ``agreement`` (one pool size
for all ranks), ``supervisor`` (spawned ranks and their control pipes), ``errors``,
``control`` (torchrun's broadcast channel), ``launch`` (the torchrun entry) and
``fault_injection`` (test-only hooks). See docs/architecture.md, "Tensor parallelism".
"""
