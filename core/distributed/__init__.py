"""Tensor-parallel groups over torch.distributed."""
