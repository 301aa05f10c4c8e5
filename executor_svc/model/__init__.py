"""Llama-family decoders over a paged KV cache: weights, layers, forward pass."""
