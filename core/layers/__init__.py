"""Model building blocks: linear, norms, rotary, sampler, attention dispatch."""
