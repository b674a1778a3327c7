"""The broker's domain errors (DESIGN.md §2 codes); each names the field at fault and the reason."""

from __future__ import annotations

from bus.errors import BerthError


def resource_not_found(resource_id: str, field: str = "resource_id") -> BerthError:
    return BerthError(
        f"resource {resource_id} not found (unknown, or released)",
        code="resource_not_found",
        field=field,
        details={"resource_id": resource_id},
    )


def already_init(resource_id: str) -> BerthError:
    return BerthError(
        f"resource {resource_id} is already initialized",
        code="resource_already_init",
        field="resource_id",
        details={"resource_id": resource_id},
    )


def already_launched(resource_id: str, status: str) -> BerthError:
    return BerthError(
        f"resource {resource_id} was already launched (status {status})",
        code="application_already_launched",
        field="resource_id",
        details={"resource_id": resource_id, "status": status},
    )


def not_launched(resource_id: str, reason: str) -> BerthError:
    return BerthError(
        f"resource {resource_id} has no application: {reason}",
        code="application_not_found",
        field="resource_id",
        details={"resource_id": resource_id},
    )


def not_running(resource_id: str, status: str) -> BerthError:
    return BerthError(
        f"resource {resource_id} is {status}, not running",
        code="resource_not_running",
        field="resource_id",
        details={"resource_id": resource_id, "status": status},
    )


def no_enough_resources(available: int, least: int, field: str = "filter.least_instance") -> BerthError:
    return BerthError(
        f"no enough resources: {available} instances available, at least {least} needed",
        code="no_enough_resources",
        field=field,
        details={"available": available, "least": least},
    )


def broker_not_enough(available: int, need: int, broker: str) -> BerthError:
    return BerthError(
        f"broker {broker} needs {need} instances, {available} available",
        code="broker_not_enough_resources",
        field="instance",
        details={"available": available, "need": need, "broker": broker},
    )


def param_not_fit(user: str) -> BerthError:
    return BerthError(
        f"no broker of user {user} fits the param",
        code="broker_param_not_fit",
        field="param",
        details={"user": user},
    )


def pool_empty(brokers: list[str]) -> BerthError:
    return BerthError(
        f"no ready resource in the fitting brokers {brokers}",
        code="broker_not_enough_resources",
        field="param",
        details={"brokers": brokers},
    )


def cooling(brokers: list[str], until: float) -> BerthError:
    return BerthError(
        f"the fitting brokers {brokers} are empty and cooling after a launch failure",
        code="broker_cooling",
        field="param",
        details={"brokers": brokers, "cooling_until": until},
    )


def broker_not_found(user: str, name: str) -> BerthError:
    return BerthError(
        f"user {user} has no broker {name}",
        code="broker_not_found",
        field="name",
        details={"user": user, "name": name},
    )
