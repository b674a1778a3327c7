"""`schemas.errors`: every code's HTTP-like status (DESIGN.md §2 and §8), wherever the code is defined."""

from __future__ import annotations

import pytest

from schemas.errors import (
    BerthError,
    BusError,
    InvalidArgument,
    NoResponders,
    RequestTimeout,
    Unavailable,
    status_of,
)
from schemas.metric_scopes import MetricValue
from services.metrics.errors import MetricExpired, MetricNotFound

# Every code DESIGN.md §2 lists, the services' other codes, and the bus's own, with §8's status.
STATUSES = {
    "invalid_argument": 400, "invalid_cpu": 400, "invalid_memory": 400, "invalid_cpu_map": 400,
    "invalid_numa_cpu": 400, "invalid_numa_memory": 400, "invalid_volume": 400, "invalid_storage": 400,
    "node_not_found": 404, "plugin_not_found": 404, "resource_not_found": 404, "application_not_found": 404,
    "metric_not_found": 404, "workload_not_found": 404, "broker_not_found": 404, "notifier_not_found": 404,
    "node_exists": 409, "workload_exists": 409, "resource_already_init": 409,
    "resource_already_released": 409, "application_already_launched": 409, "node_not_empty": 409,
    "insufficient_capacity": 409, "insufficient_resource": 409, "no_enough_resources": 409,
    "broker_not_enough_resources": 409, "broker_param_not_fit": 409,
    "resource_not_running": 412,
    "busy": 429,
    "manager_not_running": 503, "broker_cooling": 503, "unavailable": 503, "no_responders": 503,
    "timeout": 504,
    "internal": 500,
}  # fmt: skip


@pytest.mark.parametrize(("code", "status"), STATUSES.items())
def test_every_code_has_its_status(code, status):
    assert status_of(code) == status
    assert BerthError("m", code=code).status == status


def test_the_shared_errors_carry_their_codes():
    assert (InvalidArgument("count", "must be positive").code, InvalidArgument("f", "r").status) == (
        "invalid_argument", 400,
    )
    assert (Unavailable("retry").code, Unavailable("retry").status) == ("unavailable", 503)
    assert (BerthError("boom").code, BerthError("boom").status) == ("internal", 500)
    assert (RequestTimeout("berth.x", 1.0).code, RequestTimeout("berth.x", 1.0).status) == ("timeout", 504)
    assert (NoResponders("berth.x").code, NoResponders("berth.x").status) == ("no_responders", 503)


async def test_nobody_answering_a_nodes_subject_says_no_agent_serves_that_node(client, prefix):
    """`metrics.<node>.*` and `agent.<node>.*` are answered by that node's agent alone: nobody
    answering is no agent there, not a service that does not run (the code stays no_responders)."""
    for subject in ("metrics.n9.get", "agent.n9.info"):
        with pytest.raises(NoResponders) as nobody:
            await client.request(subject, {})
        assert (nobody.value.code, nobody.value.status, nobody.value.details) == (
            "no_responders", 503, {"subject": f"{prefix}.{subject}", "node": "n9"})
        assert nobody.value.message == (f"no agent serves node n9 (nobody answers on {prefix}.{subject}: is "
                                        "`berth agent` running there?)")
    with pytest.raises(NoResponders) as service:
        await client.request("resource.plugins", {})
    assert service.value.message == f"no service answers on {prefix}.resource.plugins"
    assert service.value.details == {"subject": f"{prefix}.resource.plugins"}


def test_a_reply_keeps_the_status_its_header_said():
    assert BusError("node_not_found", "m", status=500).status == 500
    assert BusError("node_not_found", "m").status == 404


def test_metrics_codes():
    assert (MetricNotFound("m").code, MetricNotFound("m").status) == ("metric_not_found", 404)
    expired = MetricExpired("old", MetricValue(1.0, 2.0), {"scope": "node"})
    assert (expired.code, expired.status) == ("metric_expired", 412)
    assert expired.details == {"scope": "node", "value": 1.0, "time": 2.0}
