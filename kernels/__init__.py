"""Attention and KV-cache kernels: Triton for CUDA, the torch reference for the CPU."""
