"""Runner side: forward_vars, pool sizing, eager forward, capture, sleep/wake."""
