"""The `turnstile` command: starts services, runs offline generation and benchmarks."""
