"""The CPU-only scheduler service: queues, KV block accounting and the per-step batch plan."""
