"""Benchmarks: the scheduler alone, and (later) serving clients."""
