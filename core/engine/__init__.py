"""Engine side: sequences, block pool and manager, scheduler. Never touches tensors."""
