"""What every Turnstile service shares: the wire protocol, configuration and ZeroMQ helpers."""
