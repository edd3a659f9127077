"""Model execution: weight loading, the KV cache pool, and the per-step forward (ModelRunner)."""
