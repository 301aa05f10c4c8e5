"""The gateway's Prometheus series: what users feel, per request."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_GAP = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)

TIME_TO_FIRST_TOKEN = Histogram(
    "turnstile:time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY
)
INTER_TOKEN_LATENCY = Histogram(
    "turnstile:inter_token_latency_seconds", "Gap between consecutive tokens", buckets=_TOKEN_GAP
)
E2E_LATENCY = Histogram(
    "turnstile:e2e_request_latency_seconds", "Arrival to last token", buckets=_LATENCY
)
REQUESTS = Counter("turnstile:http_requests", "HTTP generation requests", ["endpoint", "status"])
GATEWAY_PROMPT_TOKENS = Counter("turnstile:gateway_prompt_tokens", "Prompt tokens received")
GATEWAY_GENERATION_TOKENS = Counter("turnstile:gateway_generation_tokens", "Tokens sent back")
CONSTRAINED_REQUESTS = Counter(
    "turnstile:structured_output_requests",
    "Requests whose output a grammar constrains, by what asked for it",
    ["field"],
)
