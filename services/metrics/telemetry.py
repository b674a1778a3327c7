"""The metrics agent's Prometheus metrics (the request metrics are `bus.telemetry`'s).

    berth_metrics_sampling_duration_seconds{provisioner}   one round of a provisioner: reading the
                                                           kernel's files and storing the samples (histogram)
    berth_metrics_sampling_failures_total{provisioner}     rounds that raised (the store kept the last samples)
    berth_metrics_events_published_total                   change events this agent published
    berth_metrics_registrations{node}                      live notifier registrations of the agent's node,
                                                           read on scrape (one SCARD)
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from bus.telemetry import LATENCY_BUCKETS, GaugeTable

SAMPLING_DURATION = Histogram(
    "berth_metrics_sampling_duration_seconds",
    "Time of one sampling round of a provisioner: reading the kernel's files and storing the samples.",
    ("provisioner",),
    buckets=LATENCY_BUCKETS,
)
SAMPLING_FAILURES = Counter(
    "berth_metrics_sampling_failures", "Sampling rounds that failed, by provisioner.", ("provisioner",)
)
EVENTS_PUBLISHED = Counter("berth_metrics_events_published", "Metric change events this agent published.")
REGISTRATIONS = GaugeTable(
    "berth_metrics_registrations", "Live notifier registrations (interest in change events) of a node.", ("node",)
)


class RegistrationCount:
    def __init__(self, registrations, node: str) -> None:
        self.registrations = registrations  # notifier_store.Registrations
        self.node = node

    async def refresh(self) -> None:
        REGISTRATIONS.replace({(self.node,): await self.registrations.count()})
