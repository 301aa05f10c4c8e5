"""Executors: own device memory (weights, KV cache) and run one batch plan at a time."""
