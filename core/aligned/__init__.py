"""Trainer-aligned mode: a trainer's transformers model on the engine's deterministic
kernels, so the logprob it gives every sampled token equals the engine's bit for bit
(``docs/aligned.md``)."""

from kvrunner.aligned.align import align
from kvrunner.aligned.logprobs import token_logprobs
from kvrunner.aligned.plan import OPS, AlignedPlan
from kvrunner.aligned.rules import AlignmentError

__all__ = ["OPS", "AlignedPlan", "AlignmentError", "align", "token_logprobs"]
