"""The engine side of :class:`kvrunner.AsyncLLM`: the thread that owns the engine,
its per-request records, the deltas it streams and the stats it publishes."""
