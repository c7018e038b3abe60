"""Model definitions, the HF-format loader and the tiny-checkpoint writer."""
