from __future__ import annotations

import os

# Read when @triton.jit runs, so before any kernel module is imported: the Triton kernels run
# on the CPU through the interpreter here (tests/test_kernels.py).
os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings

settings.register_profile(
    "turnstile",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=bool(os.environ.get("CI")),
)
settings.load_profile("turnstile")
