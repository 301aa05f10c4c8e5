from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "turnstile",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=bool(os.environ.get("CI")),
)
settings.load_profile("turnstile")
