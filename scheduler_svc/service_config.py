"""The scheduler service's settings: the engine it serves, its sockets, its policy, its limits."""

from __future__ import annotations

from dataclasses import dataclass

from turnstile.shared.config import AddressConfig, EngineConfig, MetricsConfig, SchedulingConfig
from turnstile.shared.settings import nested, setting


@dataclass(slots=True, frozen=True)
class AdmissionConfig:
    """When requests are refused or failed instead of waiting on"""

    max_waiting: int | None = setting(None, "refuse new requests (HTTP 429) while this many wait")
    queue_timeout: float | None = setting(
        None, "seconds a request may wait to start before it is refused (HTTP 429)"
    )
    step_timeout: float = setting(
        60.0, "seconds a step may go unanswered: then its executor is lost"
    )
    executor_timeout: float = setting(
        30.0, "seconds requests wait for a lost executor to come back before they fail"
    )


@dataclass(slots=True, frozen=True)
class SchedulerServiceConfig:
    engine: EngineConfig = nested(EngineConfig)
    addresses: AddressConfig = nested(AddressConfig)
    scheduling: SchedulingConfig = nested(SchedulingConfig)
    admission: AdmissionConfig = nested(AdmissionConfig)
    metrics: MetricsConfig = nested(MetricsConfig)
